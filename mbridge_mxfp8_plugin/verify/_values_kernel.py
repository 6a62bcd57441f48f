"""The Triton kernel behind :class:`.fused.ValuesLaunch` (imported only where Triton is installed).

Plain (bf16, fp16, fp32) params hold their values: the shard check compares them with the main
shard's values as the gather delivers them (rounded to the buffer's dtype where it is one) cast
to the param's dtype (``batches.sides``). Captured per param, that was two gathers, a cat and
the compare: ~120 launches for 60 bias params, most of a sampled check's GPU time. Here a whole
batch is one launch: program ``p`` compares ``BLOCKS`` sampled 32-element runs of the item whose
row of ``items`` it finds by its first program (``fused.VALUE_FIELDS``: offsets from the first item's
param and main tensors, its ``Blocks.kernel_args`` and its short tail run), the sampled phase
read from a tensor as in :mod:`._te_rule_kernel`, and adds the differing elements to
``flags[flag]``.

The roundings are done on the bits with integer arithmetic (to nearest even, as torch rounds),
not by the conversion instructions: the result is the same on every GPU and in Triton's CPU
interpreter (where the tests run it), whose own bf16 conversion does not round as torch does.
A NaN against a number is a difference; NaN on both sides is equal (``batches.values_differ``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._program_rows import program_row

#: Rounding codes of ``ROUND`` and ``CAST``: none (fp32, or what is already in the dtype), bf16, fp16.
NONE, BF16, FP16 = 0, 1, 2


@triton.jit
def _to_bf16(x):
    # fp32 -> bf16 -> fp32, to nearest even (a NaN kept as it is: its low bits could round to inf).
    xi = x.to(tl.int32, bitcast=True)
    r = ((xi + 0x7FFF + ((xi >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where((xi & 0x7FFFFFFF) > 0x7F800000, x, r)


@triton.jit
def _to_fp16(x):
    # fp32 -> fp16 -> fp32, to nearest even: 11 significant bits from 2**-14 up, multiples of
    # 2**-24 below (the subnormals), past 65504 infinity.
    xi = x.to(tl.int32, bitcast=True)
    a = xi & 0x7FFFFFFF
    r = (a + 0xFFF + ((a >> 13) & 1)) & -8192
    normal = tl.where(r > 0x477FE000, 0x7F800000, r).to(tl.float32, bitcast=True)
    q = tl.where(a < 0x38800000, tl.abs(x), 0.0) * 16777216.0  # subnormal range only
    sub = ((q + 8388608.0) - 8388608.0) * 5.9604644775390625e-08  # 2**-24: exact
    mag = tl.where(a < 0x38800000, sub, normal)
    return tl.where(a > 0x7F800000, x, tl.where(xi < 0, -mag, mag))


@triton.jit
def _as(x, HOW: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
    if HOW == 1:
        return _to_bf16(x)
    elif HOW == 2:
        return _to_fp16(x)
    else:
        return x


@triton.jit
def _load(ptr, at, inside, BF16: tl.constexpr):  # noqa: N803
    x = tl.load(ptr + at, mask=inside, other=0.0)
    if BF16:  # its bits are fp32's top half (the interpreter's conversion flushes subnormals)
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _bad(
    got_ptr,
    main_ptr,
    at,
    inside,
    atol,
    ROUND: tl.constexpr,  # noqa: N803
    CAST: tl.constexpr,  # noqa: N803
    ATOL: tl.constexpr,  # noqa: N803
    GOT_BF16: tl.constexpr,  # noqa: N803
    MAIN_BF16: tl.constexpr,  # noqa: N803
):
    # Differing elements among ``inside`` of ``got_ptr[at]`` against ``main_ptr[at]``, the main
    # rounded as ``rows.to(round_to).to(dtype)`` rounds it.
    g = _load(got_ptr, at, inside, GOT_BF16)
    w = _as(_as(_load(main_ptr, at, inside, MAIN_BF16), ROUND), CAST)
    if ATOL:
        same = (tl.abs(g - w) <= atol) | (g == w)  # NaN is no "within atol"; inf equals inf
    else:
        same = g == w  # NaN equals nothing ...
    same = same | ((g != g) & (w != w))  # ... but NaN on both sides is equal
    return inside & ~same


def _values_items(
    got_ptr,
    main_ptr,
    flag_ptr,
    flag,
    phase_ptr,
    items_ptr,
    rows,
    atol,
    ROUND: tl.constexpr,  # noqa: N803 - the main's rounding to the gather's dtype (NONE, BF16, FP16)
    CAST: tl.constexpr,  # noqa: N803 - then to the param's dtype
    ATOL: tl.constexpr,  # noqa: N803 - compare within ``atol``, else exactly
    BLOCKS: tl.constexpr,  # noqa: N803
    OFF_DIV: tl.constexpr,  # noqa: N803 - the runs' offsets are stored divided by it
    GOT_BF16: tl.constexpr,  # noqa: N803 - the param's values are bf16
    MAIN_BF16: tl.constexpr,  # noqa: N803 - the main shard is
    ROWS: tl.constexpr,  # noqa: N803 - ``_program_rows.MAX_ROWS``
):
    p = tl.program_id(0)
    row = program_row(items_ptr, rows, p, 12, 2, ROWS)
    got = got_ptr + tl.load(row) * OFF_DIV  # the item's run 0, in the param and in the main shard
    main = main_ptr + tl.load(row + 1) * OFF_DIV
    chunk = p - tl.load(row + 2)
    start, lo, count = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
    n, mod, step = tl.load(row + 6), tl.load(row + 7), tl.load(row + 8)
    # The sampled runs at the phase (as ``_te_rule_kernel._differing`` picks blocks): indices
    # past the phase's last run (at most the slice's last one) are masked.
    first = tl.load(phase_ptr) % mod
    b = chunk * BLOCKS + tl.arange(0, BLOCKS)
    i = lo + b.to(tl.int64)
    live = (b < count) & (i < (n - first + step - 1) // step)
    lane = tl.arange(0, 32)
    at = ((start + first + i * step) * 32)[:, None] + lane[None, :]
    inside = live[:, None] & (lane < 32)[None, :]
    bad = _bad(got, main, at, inside, atol, ROUND, CAST, ATOL, GOT_BF16, MAIN_BF16)
    bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    # The item's short run past its last whole one (none: length 0), by its first program.
    tail = lane < tl.where(chunk == 0, tl.load(row + 11), 0)
    got, main = got_ptr + tl.load(row + 9), main_ptr + tl.load(row + 10)
    odd = _bad(got, main, lane, tail, atol, ROUND, CAST, ATOL, GOT_BF16, MAIN_BF16)
    bad += tl.sum(odd.to(tl.int32), axis=0)
    tl.atomic_add(flag_ptr + flag, bad, mask=bad != 0)  # adding 0 would queue on one address


#: One launch per batch (the items' geometry is data): nothing to specialize.
items_kernel = triton.jit(_values_items, do_not_specialize=["flag", "rows"])
