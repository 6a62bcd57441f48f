"""verify/fingerprint.py, asked at every check: a kept plan is reused only while every tensor it
reads is the same object at the same address. Written for speed (issue 32: it was most of a
replayed check's host time), so each way a plan can go stale is pinned here, for both judges: a
new fingerprint differs, and ``unchanged`` (the identity check a replayed call makes) says no."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness.tensors import StoragelessTensor

from mbridge_mxfp8_plugin.verify import fingerprint


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer

    quantized = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(torch.randn(4, 64))
    plain = torch.nn.Parameter(torch.randn(64))
    mains = [torch.randn(256), torch.randn(64)]
    state = {"params": [quantized, plain], "mains": mains}
    monkeypatch.setattr(fingerprint, "params_of", lambda chunks: list(state["params"]))
    monkeypatch.setattr(fingerprint, "main_params", lambda optimizer: list(state["mains"]))
    return state


def _fp() -> fingerprint.Fingerprint:
    return fingerprint.fingerprint([], None)


def _holds(kept: fingerprint.Fingerprint) -> bool:
    return fingerprint.unchanged(kept, [], None)


def test_unchanged_tensors_give_the_same_fingerprint(layout: dict[str, Any]) -> None:
    kept = _fp()
    assert kept and _fp() == kept and _holds(kept)


@pytest.mark.parametrize(
    "change",
    [
        "rebind codes",
        "move plain data",
        "shrink plain data",
        "swap main",
        "move main",
        "new param",
        "quantizer",
    ],
)
def test_each_way_a_plan_goes_stale_changes_it(layout: dict[str, Any], change: str) -> None:
    before = _fp()
    quantized, plain = layout["params"]
    if change == "rebind codes":
        quantized._rowwise_data = quantized._rowwise_data.clone()
    elif change == "move plain data":
        plain.data = plain.data.clone()
    elif change == "shrink plain data":  # the same first element: only the shape tells
        plain.data = plain.data[:32]
    elif change == "swap main":
        layout["mains"][1] = layout["mains"][1].clone()
    elif change == "move main":
        layout["mains"][0].set_(torch.randn(256))
    elif change == "new param":
        layout["params"][1] = torch.nn.Parameter(plain.data)
    else:
        quantized._quantizer = object()
    assert _fp() != before
    assert not _holds(before)


def test_an_equal_value_in_a_new_object_sends_the_check_to_a_new_fingerprint(layout: dict[str, Any]) -> None:
    """``unchanged`` compares identities only: a layout attribute set again to an equal value in
    another object is not vouched for by it, and the new fingerprint (by value) then finds the
    layout the same, so the plan is kept (``weights._layout_of`` keeps the new one)."""
    quantized = layout["params"][0]
    quantized._fp8_dtype = "float8_e4m3fn"
    before = _fp()
    quantized._fp8_dtype = "".join(["float8_", "e4m3fn"])  # equal, another object
    assert quantized._fp8_dtype is not before.dict_values[fingerprint._NAMES.index("_fp8_dtype")][0]
    assert not _holds(before) and _fp() == before


def test_the_tensors_it_addressed_are_those_a_plan_reads_by_address(layout: dict[str, Any]) -> None:
    """What a kept graph's launch is guarded by (``weights._replay_early`` compares their
    addresses): the codes and scales a quantized param holds, a plain param, every main shard."""
    addressed = _fp().addressed
    quantized, plain = layout["params"]
    want = {id(t) for t in (quantized._rowwise_data, quantized._rowwise_scale_inv, plain, *layout["mains"])}
    got = {id(t) for t in addressed}
    # not the quantized param itself: TE's wrapper refuses a data pointer, the kit's reports 0
    # (nothing is read through either; each would be a read of every replayed call for nothing)
    assert got == want, [type(t).__name__ for t in addressed]


def test_a_tensor_at_address_zero_is_kept_by_object_not_guarded_by_address(layout: dict[str, Any]) -> None:
    """An empty param (``data_ptr`` 0) is in the fingerprint (its object), not in what the launch
    guard reads; replaced, the fingerprint changes."""
    empty = torch.nn.Parameter(torch.empty(0))
    layout["params"].append(empty)
    first = _fp()
    assert all(t is not empty for t in first.addressed) and 0 not in first.pointers
    assert _fp() == first and _holds(first)
    layout["params"][-1] = torch.nn.Parameter(torch.empty(0))
    assert _fp() != first and not _holds(first)


def test_addresses_read_just_before_need_not_be_read_again(layout: dict[str, Any]) -> None:
    """A replayed check compares the addresses once, before its launch (``weights._replay_early``),
    and tells ``unchanged`` so; everything else is still re-read."""
    kept = _fp()
    layout["mains"][0].set_(torch.randn(256))  # moved in place: only its address tells
    assert not fingerprint.unchanged(kept, [], None) and _fp() != kept
    assert fingerprint.unchanged(kept, [], None, addresses_read=True)  # the caller's word for it
    layout["mains"][1] = layout["mains"][1].clone()
    assert not fingerprint.unchanged(kept, [], None, addresses_read=True)


def test_a_plain_param_with_one_of_the_attributes_is_read_as_the_others(layout: dict[str, Any]) -> None:
    """A plain param is read as the quantized ones are: an attribute set on one is seen."""
    before = _fp()
    layout["params"][1]._scale_inv = torch.ones(1)
    assert _fp() != before and not _holds(before)


class _Declared(torch.Tensor):
    """A param type that declares its codes as a property, and one more view through a slot-like
    class default: read through getattr, not the instance dict."""

    _fp8_dtype = None  # a class default the instance may shadow

    @property
    def _rowwise_data(self) -> torch.Tensor:
        return self.__dict__["_store"]


class _Dynamic(torch.Tensor):
    """A param type that resolves attributes itself."""

    def __getattr__(self, name: str) -> Any:
        if name == "_quantizer":
            return self.__dict__.get("_hidden")
        raise AttributeError(name)


@pytest.mark.parametrize("kind", ["property", "class default", "__getattr__", "absent"])
def test_attributes_a_class_declares_are_read_through_it(layout: dict[str, Any], kind: str) -> None:
    """The walk reads instance attributes from the instance's dict; what the class declares (a
    property, a class default, ``__getattr__``) must still be read, and a change to it seen."""
    if kind == "__getattr__":
        param = torch.randn(8).as_subclass(_Dynamic)
        param.__dict__["_hidden"] = "a"
    else:
        param = torch.randn(8).as_subclass(_Declared)
        param.__dict__["_store"] = torch.randn(8)
    layout["params"].append(param)
    before = _fp()
    if kind == "property":
        param.__dict__["_store"] = torch.randn(8)  # the property now returns another tensor
    elif kind == "class default":
        param._fp8_dtype = "e4m3"  # type: ignore[attr-defined]
    elif kind == "__getattr__":
        param.__dict__["_hidden"] = "b"
    else:  # a name neither the instance nor the class has, then set on the instance
        param._scale_inv = torch.ones(1)  # type: ignore[attr-defined]
    assert _fp() != before, kind
    assert not _holds(before), kind


def test_a_param_without_storage_is_addressed_by_object(layout: dict[str, Any]) -> None:
    """Its ``data_ptr`` raises: the fingerprint still forms (not empty, so plans are kept), stays
    the same while nothing changes, and changes when the param object is replaced."""
    layout["params"].append(StoragelessTensor((4, 64)))
    first = _fp()
    assert first and _fp() == first and _holds(first)
    layout["params"][-1] = StoragelessTensor((4, 64))
    assert _fp() != first and not _holds(first)


def test_a_partial_reread_sees_what_a_plan_reads_at_every_phase_and_the_rest_at_its_own(
    layout: dict[str, Any],
) -> None:
    """``unchanged`` with ``part=(phase, stride)`` (a sampled check's call): what the plan reads
    and how it reads it (the params and main shards there are, every address, every attribute a
    param had) is re-read at every phase; what no framework changes on a live param (its class,
    its shape, an attribute it did not have) only at the phase of its own index, ``index %
    stride``. Without ``part``, everything."""
    stride = 2

    def seen_at(kept: fingerprint.Fingerprint) -> list[int]:
        return [
            phase for phase in range(stride) if not fingerprint.unchanged(kept, [], None, (phase, stride))
        ]

    quantized, plain = layout["params"]
    kept = _fp()
    assert seen_at(kept) == [] and fingerprint.unchanged(kept, [], None)
    every = {
        "codes re-bound": lambda: setattr(quantized, "_rowwise_data", quantized._rowwise_data.clone()),
        "quantizer": lambda: setattr(quantized, "_quantizer", object()),
        "scale-layout mark": lambda: setattr(quantized, "_with_gemm_swizzled_scales", True),
        "main moved": lambda: layout["mains"][1].set_(torch.randn(64)),
        "main swapped": lambda: layout["mains"].__setitem__(0, layout["mains"][0].clone()),
        "param swapped": lambda: layout["params"].__setitem__(1, torch.nn.Parameter(plain.data)),
    }
    for what, change in every.items():
        kept = _fp()
        change()
        assert seen_at(kept) == [0, 1], what
        layout["params"][:], layout["mains"][:] = [quantized, plain], list(layout["mains"])
    quantized, plain = layout["params"]
    rotated = {  # (index of the param it changes, the change)
        "attribute it did not have": (
            1,
            lambda: setattr(plain, "_rowwise_data", torch.zeros(64, dtype=torch.uint8)),
        ),
        "shape in place": (1, lambda: setattr(plain, "data", plain.data[:32])),
        "class": (0, lambda: setattr(quantized, "_fp8_dtype", quantized._fp8_dtype)),
    }
    for what, (index, change) in rotated.items():
        kept = _fp()
        change()
        if what == "class":  # same attributes, another class: the param's type alone changed
            quantized.__class__ = type("Renamed", (type(quantized),), {})
        assert seen_at(kept) == [index % stride], what
        assert not fingerprint.unchanged(kept, [], None), what
