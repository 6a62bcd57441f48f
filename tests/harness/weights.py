"""What a run records, and the checkpoint-weight comparisons shared by the save tests.

Every harness loop (Bridge's replica, the robustness cases, the scenarios, Megatron-LM's order)
records the same four things, :class:`RunRecord`, and adds its own on a subclass. A reference run
keeps bf16 params; an MXFP8 run holds the same values rounded to MXFP8, so the expected MXFP8
checkpoint is the reference's weights quantized (biases stay bf16).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing import mxfp8_quantize


@dataclass
class RunRecord:
    """Losses one run produced (DP means, equal on every rank) and the weights it held: at each save
    (by step; what dist-checkpointing writes, ``param.data``) and at the end."""

    train_losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    saved_weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    final_weights: dict[str, torch.Tensor] = field(default_factory=dict)


def weights_of(model: list[Any]) -> dict[str, torch.Tensor]:
    """``"<chunk>.<param name>"`` -> an fp32 copy of ``param.data``, for every chunk."""
    return {
        f"{i}.{n}": p.detach().float().clone()
        for i, chunk in enumerate(model)
        for n, p in chunk.named_parameters()
    }


def expected_mxfp8_weights(ref_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (mxfp8_quantize(v) if k.endswith("weight") else v) for k, v in ref_weights.items()}


def worst_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def assert_off_on(diffs: Mapping[Any, float], plugin: bool, tol: float = 1e-4) -> None:
    """The project's defect check on differences from the reference run: with the plugin every one
    is within ``tol``; without it every one is well outside (10x; NaN counts as outside), so the
    defect shows at each point checked and the test can fail."""
    if plugin:
        assert all(d <= tol for d in diffs.values()), diffs
    else:
        assert not any(d <= 10 * tol for d in diffs.values()), diffs
