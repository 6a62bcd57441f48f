"""verify/fingerprint.py, taken at every check: a kept plan is reused only while every tensor it
reads is the same object at the same address. Rewritten flat for speed (issue 32:
it was most of a replayed check's host time), so each way a plan can go stale is pinned here."""

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


def _fp() -> tuple[Any, ...]:
    return fingerprint.fingerprint([], None)


def test_unchanged_tensors_give_the_same_fingerprint(layout: dict[str, Any]) -> None:
    assert _fp() and _fp() == _fp()


@pytest.mark.parametrize(
    "change",
    ["rebind codes", "move plain data", "swap main", "move main", "new param", "quantizer"],
)
def test_each_way_a_plan_goes_stale_changes_it(layout: dict[str, Any], change: str) -> None:
    before = _fp()
    quantized, plain = layout["params"]
    if change == "rebind codes":
        quantized._rowwise_data = quantized._rowwise_data.clone()
    elif change == "move plain data":
        plain.data = plain.data.clone()
    elif change == "swap main":
        layout["mains"][1] = layout["mains"][1].clone()
    elif change == "move main":
        layout["mains"][0].set_(torch.randn(256))
    elif change == "new param":
        layout["params"][1] = torch.nn.Parameter(plain.data)
    else:
        quantized._quantizer = object()
    assert _fp() != before


def test_the_tensors_it_addressed_are_those_a_plan_reads_by_address(layout: dict[str, Any]) -> None:
    """What a kept graph's launch is guarded by (``weights._replay_early`` compares their
    addresses): the codes and scales a quantized param holds, a plain param, every main shard."""
    addressed: list[Any] = []
    fingerprint.fingerprint([], None, addressed)
    quantized, plain = layout["params"]
    want = {id(t) for t in (quantized._rowwise_data, quantized._rowwise_scale_inv, plain, *layout["mains"])}
    got = {id(t) for t in addressed}
    # the quantized param itself too where it has storage (the kit's; TE's is a storage-less wrapper)
    assert want <= got <= want | {id(quantized)}, [type(t).__name__ for t in addressed]


def test_addresses_read_just_before_stand_only_for_those_very_tensors(layout: dict[str, Any]) -> None:
    """A replayed check reads the addresses once (its launch's guard) and hands them on, so the
    fingerprint need not read every tensor again; they stand in only for the same objects. After
    a main shard is swapped for another, the fingerprint is the one taken afresh (else the next
    check's would differ from it, and no plan would be kept)."""
    addressed: list[Any] = []
    first = fingerprint.fingerprint([], None, addressed)
    pointers = [t.data_ptr() for t in addressed]
    assert fingerprint.fingerprint([], None, known=(addressed, pointers)) == first
    layout["mains"][0] = layout["mains"][0].clone()
    assert fingerprint.fingerprint([], None, known=(addressed, pointers)) == _fp() != first


def test_a_plain_param_with_one_of_the_attributes_is_read_as_the_others(layout: dict[str, Any]) -> None:
    """A plain param is read as the quantized ones are: an attribute set on one is seen."""
    before = _fp()
    layout["params"][1]._scale_inv = torch.ones(1)
    assert _fp() != before


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


def test_a_param_without_storage_is_addressed_by_object(layout: dict[str, Any]) -> None:
    """Its ``data_ptr`` raises: the fingerprint still forms (not empty, so plans are kept), stays
    the same while nothing changes, and changes when the param object is replaced."""
    layout["params"].append(StoragelessTensor((4, 64)))
    first = _fp()
    assert first and _fp() == first
    layout["params"][-1] = StoragelessTensor((4, 64))
    assert _fp() != first
