"""Checkpoint-weight comparisons shared by the save tests.

A reference run keeps bf16 params; an MXFP8 run holds the same values rounded to MXFP8, so the
expected MXFP8 checkpoint is the reference's weights quantized (biases stay bf16).
"""

from __future__ import annotations

import torch

from mbridge_mxfp8_plugin.testing import mxfp8_quantize


def expected_mxfp8_weights(ref_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (mxfp8_quantize(v) if k.endswith("weight") else v) for k, v in ref_weights.items()}


def worst_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)
