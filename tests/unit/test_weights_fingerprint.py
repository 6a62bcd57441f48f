"""verify/weights.py's layout fingerprint, taken at every check: a kept plan is reused only while
every tensor it reads is the same object at the same address. Rewritten flat for speed (issue 32:
it was most of a replayed check's host time), so each way a plan can go stale is pinned here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.verify import weights


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer

    quantized = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(torch.randn(4, 64))
    plain = torch.nn.Parameter(torch.randn(64))
    mains = [torch.randn(256), torch.randn(64)]
    state = {"params": [quantized, plain], "mains": mains}
    monkeypatch.setattr(weights, "_buffer_params", lambda chunks: [(None, p) for p in state["params"]])
    monkeypatch.setattr(weights, "main_params", lambda optimizer: list(state["mains"]))
    return state


def _fp() -> tuple[Any, ...]:
    return weights._fingerprint([], None)


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


def test_a_plain_param_with_one_of_the_attributes_is_read_as_the_others(layout: dict[str, Any]) -> None:
    """The fast path for plain params (no lookups that miss) does not hide an attribute set on one."""
    before = _fp()
    layout["params"][1]._scale_inv = torch.ones(1)
    assert _fp() != before
