"""The Triton kernel behind :class:`.fused.GatherLaunch` (imported only where Triton is installed).

A batch of MXFP8 params the fused kernel does not compare goes through the type's own write:
the items' sampled main blocks gathered into one ``(k, 32)`` buffer (rounded as the gather
delivers them, zero rows up to whole 32-row tiles: ``batches.main_rows``) and the param's codes
and scale bytes into two more (``batches.got_bytes``). Captured per item that was three gathers
(``Phased.take``, ``take_scales``) and the cats, most of the check's GPU time. Here a batch is one
launch: program ``p`` copies ``BLOCKS`` sampled blocks of item ``programs[p]`` (its row of
``items``, ``fused.GATHER_FIELDS``) at the phase its tensor holds, picking indices as
``sampling.Phase.local`` does (past the phase's last block, the one before it), into rows
``out ..`` of the buffers. A row with ``n == 0`` writes zero main rows (the tile's padding).

The main is moved as bits (integer views); its rounding fp32 -> bf16 is done on them, to nearest
even (subnormals included), a NaN becoming 0x7FC0 as torch's CPU conversion makes it.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _gather_items(
    main_ptr,
    codes_ptr,
    scales_ptr,
    rows_ptr,
    out_codes_ptr,
    out_scales_ptr,
    phase_ptr,
    items_ptr,
    programs_ptr,
    ROUND_BF16: tl.constexpr,  # noqa: N803 - Triton's constexpr convention
    BLOCKS: tl.constexpr,  # noqa: N803
):
    p = tl.program_id(0)
    row = items_ptr + tl.load(programs_ptr + p).to(tl.int64) * 13
    main = main_ptr + tl.load(row)  # element i of the item's param at main[i], codes[i]
    codes = codes_ptr + tl.load(row + 1)
    scales = scales_ptr + tl.load(row + 2)
    chunk = p - tl.load(row + 3)
    out = tl.load(row + 4)
    start, lo, count = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    n, mod, step = tl.load(row + 8), tl.load(row + 9), tl.load(row + 10)
    per_row, scale_cols = tl.load(row + 11), tl.load(row + 12)
    first = tl.load(phase_ptr) % mod
    b = (chunk * BLOCKS + tl.arange(0, BLOCKS)).to(tl.int64)
    live = b < count
    real = live & (b * 0 + n > 0)
    i = first + (lo + b) * step
    i = tl.where(i >= n, i - step, i)  # as Phase.local: the missing last block reads its neighbour
    g = start + i
    lane = tl.arange(0, 32)
    at = (g * 32)[:, None] + lane[None, :]
    dst = ((out + b) * 32)[:, None] + lane[None, :]
    inside = real[:, None] & (lane < 32)[None, :]
    stored = live[:, None] & (lane < 32)[None, :]
    x = tl.load(main + at, mask=inside, other=0)
    if ROUND_BF16:  # fp32 bits (int32) -> bf16 bits, to nearest even, as unsigned 32-bit values
        u = x.to(tl.int64) & 0xFFFFFFFF
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        x = (r - ((r >> 15) << 16)).to(tl.int16)  # two's complement of the 16 bits
    tl.store(rows_ptr + dst, x, mask=stored)
    c = tl.load(codes + at, mask=inside, other=0)
    tl.store(out_codes_ptr + dst, c, mask=inside)
    s = tl.load(scales + (g // per_row) * scale_cols + g % per_row, mask=real, other=0)
    tl.store(out_scales_ptr + out + b, s, mask=real)


#: One launch per batch (the items' geometry is data): nothing to specialize.
items_kernel = triton.jit(_gather_items)
