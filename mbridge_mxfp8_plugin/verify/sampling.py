"""Which blocks a sampled check compares, as plain integer arithmetic over block ids.

Kept apart from the checks that use it so the shard check and the replica fold agree on one
rotation: a phase that depends on ``offset % stride`` only, so plans repeat every ``stride``
calls and every block is visited within that many.
"""

from __future__ import annotations

from typing import Any

from ..errors import MXFP8UsageError
from .read import BLOCK, Blocks

__all__ = ["first_sampled", "mxfp8_blocks", "runs", "stride_of"]


def stride_of(sample: float) -> int:
    if not 0.0 < sample <= 1.0:
        raise MXFP8UsageError(f"verify sample must be in (0, 1], got {sample!r}")
    return max(1, round(1.0 / sample))


def first_sampled(offset: int, stride: int, blocks: int) -> int:
    """The first sampled block of ``blocks``: rotates with ``offset`` over ``min(stride, blocks)``
    phases, so every block is visited within ``stride`` calls and every param yields one. It
    depends on ``offset % stride`` only, so a check's plan repeats every ``stride`` calls."""
    return (offset % stride) % max(1, min(stride, blocks))


def _every(first: int, blocks: int, stride: int) -> int:
    return max(0, -(-(blocks - first) // stride))


def mxfp8_blocks(param: Any, s: int, e: int, offset: int, stride: int) -> tuple[Blocks, int]:
    """The sampled blocks lying wholly inside the shard ``[s, e)``, and the elements in all
    whole blocks there. A block straddling two ranks' shards has a scale this rank cannot
    compute, so it is skipped (and counted)."""
    last = param.shape[-1] if param.dim() > 0 else 1
    per_row = -(-last // BLOCK)
    # Whole blocks inside [s, e) form one range of global block ids (row * per_row + j).
    r, c = divmod(s, last)
    j = -(-c // BLOCK)
    g0 = r * per_row + j if j < per_row else (r + 1) * per_row
    r, c = divmod(e, last)
    g1 = max(g0, r * per_row + c // BLOCK)
    n = g1 - g0
    first = first_sampled(offset, stride, n)
    blocks = Blocks(last, g0 + first, _every(first, n, stride), stride)
    # Elements in whole blocks: each row's last block holds only ``last % 32``.
    short = 0 if last % BLOCK == 0 else (g1 // per_row - g0 // per_row) * (BLOCK - last % BLOCK)
    return blocks, n * BLOCK - short


def runs(s: int, e: int, offset: int, stride: int) -> tuple[Blocks, int]:
    """Runs of 32 counted from the shard start (no scale: any grouping compares the same), and
    how many elements of the short run at the shard's end are compared too. That run is taken
    only where every run is, or where it is the only one, so a sampled check still skips it."""
    n = (e - s) // BLOCK
    first = first_sampled(offset, stride, n)
    blocks = Blocks(BLOCK, first, _every(first, n, stride), stride, origin=s)
    tail = (e - s) % BLOCK if stride == 1 or n == 0 else 0
    return blocks, tail
