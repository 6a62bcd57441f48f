"""The Triton kernels behind :class:`.fused.GatherLaunch` (imported only where Triton is installed).

A batch of MXFP8 params the fused kernel does not compare goes through the type's own write:
the items' sampled main blocks gathered into one ``(k, 32)`` buffer (rounded as the gather
delivers them, zero rows up to whole 32-row tiles: ``batches.main_rows``), written by the type,
and its codes and scale bytes compared with the param's. Captured per item that was three
gathers (``Phased.take``, ``take_scales``), the cats and two compares, most of the check's GPU
time. Here a batch is two launches around the write: ``_gather_items`` copies the main rows,
``_compare_items`` counts the written bytes that differ from the param's, reading the param's
codes and scales where they lie (no gathered copy: on a full check of the one-pass stand-in
the copy was a quarter of the gather's traffic, and it was alive during the write). Program
``p`` handles ``BLOCKS`` sampled blocks of the item whose row of ``items`` it finds by its first
program (``fused.GATHER_FIELDS``) at the phase its tensor holds, picking indices as
``sampling.Phase.local`` does (past the phase's last block, the one before it); its blocks are
rows ``out ..`` of the batch's buffers. A row with ``n == 0`` writes zero main rows (the tile's
padding) and compares nothing.

The main is moved as bits (integer views); its rounding fp32 -> bf16 is done on them, to nearest
even (subnormals included), a NaN becoming 0x7FC0 as torch's CPU conversion makes it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._program_rows import program_row


@triton.jit
def _sampled(phase_ptr, items_ptr, rows, batch_ptr, batch_stride, BLOCKS: tl.constexpr, ROWS: tl.constexpr):  # noqa: N803
    """Program ``p``'s item row and blocks: its global block ids ``g``, output rows ``out + b``,
    which are the batch's (``live``) and which are real blocks (``real``, not tile padding). The
    table is the one ``batch_ptr`` selects, ``batch_stride`` elements apart (a template's)."""
    p = tl.program_id(0)
    items_ptr += tl.load(batch_ptr) * batch_stride
    row = program_row(items_ptr, rows, p, 13, 3, ROWS)
    chunk = p - tl.load(row + 3)
    out = tl.load(row + 4)
    start, lo, count = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    n, mod, step = tl.load(row + 8), tl.load(row + 9), tl.load(row + 10)
    first = tl.load(phase_ptr) % mod
    b = (chunk * BLOCKS + tl.arange(0, BLOCKS)).to(tl.int64)
    live = b < count
    real = live & (b * 0 + n > 0)
    i = first + (lo + b) * step
    i = tl.where(i >= n, i - step, i)  # as Phase.local: the missing last block reads its neighbour
    return row, start + i, out + b, live, real


def _gather_items(
    main_ptr,
    rows_ptr,
    phase_ptr,
    items_ptr,
    rows,
    batch_ptr,
    batch_stride,
    ROUND_BF16: tl.constexpr,  # noqa: N803 - Triton's constexpr convention
    BLOCKS: tl.constexpr,  # noqa: N803
    OFF_DIV: tl.constexpr,  # noqa: N803 - main and codes offsets are stored divided by it
    ROWS: tl.constexpr,  # noqa: N803 - ``_program_rows.MAX_ROWS``
):
    row, g, dst_row, live, real = _sampled(phase_ptr, items_ptr, rows, batch_ptr, batch_stride, BLOCKS, ROWS)
    main = main_ptr + tl.load(row) * OFF_DIV  # element i of the item's param at main[i]
    lane = tl.arange(0, 32)
    at = (g * 32)[:, None] + lane[None, :]
    dst = (dst_row * 32)[:, None] + lane[None, :]
    inside = real[:, None] & (lane < 32)[None, :]
    stored = live[:, None] & (lane < 32)[None, :]
    x = tl.load(main + at, mask=inside, other=0)
    if ROUND_BF16:  # fp32 bits (int32) -> bf16 bits, to nearest even, as unsigned 32-bit values
        u = x.to(tl.int64) & 0xFFFFFFFF
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        x = (r - ((r >> 15) << 16)).to(tl.int16)  # two's complement of the 16 bits
    tl.store(rows_ptr + dst, x, mask=stored)


def _compare_items(
    codes_ptr,
    scales_ptr,
    written_ptr,
    written_scales_ptr,
    written_scale_stride,
    count_ptr,
    phase_ptr,
    items_ptr,
    rows,
    batch_ptr,
    batch_stride,
    BLOCKS: tl.constexpr,  # noqa: N803
    OFF_DIV: tl.constexpr,  # noqa: N803
    ROWS: tl.constexpr,  # noqa: N803
):
    row, g, out, _, real = _sampled(phase_ptr, items_ptr, rows, batch_ptr, batch_stride, BLOCKS, ROWS)
    codes = codes_ptr + tl.load(row + 1) * OFF_DIV  # element i of the item's param at codes[i]
    scales = scales_ptr + tl.load(row + 2)
    per_row, scale_cols = tl.load(row + 11), tl.load(row + 12)
    lane = tl.arange(0, 32)
    inside = real[:, None] & (lane < 32)[None, :]
    got = tl.load(codes + (g * 32)[:, None] + lane[None, :], mask=inside, other=0)
    want = tl.load(written_ptr + (out * 32)[:, None] + lane[None, :], mask=inside, other=0)
    got_s = tl.load(scales + (g // per_row) * scale_cols + g % per_row, mask=real, other=0)
    want_s = tl.load(written_scales_ptr + out * written_scale_stride, mask=real, other=0)
    differing = tl.sum(tl.sum((got != want).to(tl.int32), axis=1), axis=0)
    differing += tl.sum((got_s != want_s).to(tl.int32), axis=0)
    # a template's count per batch; only where something differs (programs of a whole batch
    # adding 0 to one address queue behind each other in the cache)
    tl.atomic_add(count_ptr + tl.load(batch_ptr), differing, mask=differing != 0)


#: One launch each per batch segment (the items' geometry is data): nothing to specialize on the
#: table's length or the written scales' stride (each value would be a compile of its own).
items_kernel = triton.jit(_gather_items, do_not_specialize=["rows", "batch_stride"])
compare_kernel = triton.jit(
    _compare_items, do_not_specialize=["rows", "written_scale_stride", "batch_stride"]
)
