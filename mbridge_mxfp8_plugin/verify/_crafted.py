"""Blocks where MXFP8 scale and rounding rules part, for the fused kernel's gate (``probe``).

A type may hand its compares to the TE-rule kernel only if the two write the same bytes; its own
first blocks rarely reach the cases where rules differ, so these are added: made once per
process on the host, copied to the device at each plan's probe.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .read import BLOCK

__all__ = ["crafted_rows"]


def crafted_rows(device: Any) -> torch.Tensor:
    """fp32 blocks (bf16-exact) where MXFP8 scale and rounding rules part, ``(k, 32)``, ``k`` a
    multiple of 32: amax at and around ``448 * 2**n`` and with mantissas past 1.75 (TE rounds the
    scale up where the OCP spec's floor saturates), round-half ties, E4M3 subnormals and what
    underflows to zero, zeros of both signs, and amax from 2**-120 to 2**120. Made once per
    process (about a hundred small host operations: 2 ms of a plan's first call on an H100's
    host), a copy on ``device`` per call."""
    return _crafted_host().to(device, copy=True)


@functools.cache
def _crafted_host() -> torch.Tensor:
    gen = torch.Generator().manual_seed(23)
    rows: list[torch.Tensor] = []
    for n in (-120, -100, -30, -9, -6, -1, 0, 1, 7, 30, 100, 120):
        scale = 2.0**n
        for top in (1.0, 1.5, 1.75, 1.78125, 1.875, 1.9921875, 1.0078125):
            block = torch.randn(BLOCK, generator=gen) * scale * 0.5
            block[0] = top * scale * (1 if n % 2 else -1)
            rows.append(block)
        ties = torch.arange(BLOCK, dtype=torch.float32) * 0.0625 * scale + scale  # halfway codes
        ties[-1] = 448.0 * scale / 256.0
        rows.append(ties)
        wide = scale * torch.exp2(-torch.arange(BLOCK, dtype=torch.float32) * 0.5)  # E4M3 subnormals
        wide[1::2] *= -1
        rows.append(wide)
    rows.append(torch.zeros(BLOCK))
    rows.append(torch.zeros(BLOCK).neg())
    out = torch.stack(rows).to(torch.bfloat16).float()
    pad = (-out.shape[0]) % BLOCK
    if pad:
        out = torch.cat([out, torch.randn(pad, BLOCK, generator=gen).to(torch.bfloat16).float()])
    return out
