"""The Triton kernel behind :mod:`.fused` (imported only where Triton is installed).

One program compares ``BLOCKS`` sampled 32-element blocks (the sampled phase read from a tensor,
so a captured launch serves every phase): it loads the main shard's elements,
rounds them to bf16 as the gather delivers them, casts each block by Transformer Engine's MXFP8
rule (:mod:`mbridge_mxfp8_plugin.common.mxfp8_cast` states it) and compares the E4M3 bytes and the E8M0
byte with the param's, adding the differing bytes into ``flags[flag]``. Every float conversion is
done on the bits with integer arithmetic, not by the hardware's conversion instructions: the
result is then the same on every GPU and in Triton's CPU interpreter (where the tests run it),
whose own bf16 and FP8 conversions do not round as torch does. The interpreter is chosen by
``TRITON_INTERPRET=1`` before Triton is first imported (Triton patches its language then).

``kernel`` compares one param's blocks per launch; ``items_kernel`` a whole batch's, its items'
addresses and geometry read from tables (``fused.Launch``), because per-param launches were most
of a sampled check's GPU time. Both run the same ``_differing``, so they cannot disagree on a rule.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._program_rows import program_row


def _te_cast_compare(
    main_ptr,
    codes_ptr,
    scales_ptr,
    flag_ptr,
    flag,
    phase_ptr,
    base_q,
    start,
    lo,
    count,
    n,
    mod,
    step,
    last_q,
    per_row,
    scale_cols,
    rcp,
    ROUND_BF16: tl.constexpr,  # noqa: N803 - Triton's constexpr convention
    BLOCKS: tl.constexpr,  # noqa: N803
    BASE_DIV: tl.constexpr,  # noqa: N803 - base = base_q * BASE_DIV
    LAST_DIV: tl.constexpr,  # noqa: N803 - last = last_q * LAST_DIV
):
    # The divisors as constants let the compiler prove 16-byte alignment of a block's elements
    # (vector loads) without specializing on every integer's value.
    bad = _differing(
        main_ptr + base_q * BASE_DIV, codes_ptr, scales_ptr, phase_ptr, tl.program_id(0), start, lo, count,
        n, mod, step, last_q * LAST_DIV, per_row, scale_cols, rcp, ROUND_BF16, BLOCKS, LAST_DIV == 32,
    )  # fmt: skip
    tl.atomic_add(flag_ptr + flag, bad, mask=bad != 0)  # adding 0 would queue on one address


def _te_cast_compare_items(
    main_ptr,
    codes_ptr,
    scales_ptr,
    flag_ptr,
    flag,
    phase_ptr,
    items_ptr,
    rows,
    rcp,
    ROUND_BF16: tl.constexpr,  # noqa: N803
    BLOCKS: tl.constexpr,  # noqa: N803
    OFF_DIV: tl.constexpr,  # noqa: N803 - main and codes offsets are stored divided by it
    LAST_DIV: tl.constexpr,  # noqa: N803
    ROWS: tl.constexpr,  # noqa: N803 - ``_program_rows.MAX_ROWS``
):
    # A batch's items in one launch: program p compares chunk ``p - first`` of the item whose
    # row of ``items`` (``fused.ITEM_FIELDS``) it finds by its first program; the row holds its
    # offsets from the first item's tensors (main and codes in elements, scales in bytes) and
    # its geometry.
    p = tl.program_id(0)
    row = program_row(items_ptr, rows, p, 13, 3, ROWS)
    main = main_ptr + tl.load(row) * OFF_DIV
    codes = codes_ptr + tl.load(row + 1) * OFF_DIV
    scales = scales_ptr + tl.load(row + 2)
    chunk = p - tl.load(row + 3)
    start, lo, count = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    n, mod, step = tl.load(row + 7), tl.load(row + 8), tl.load(row + 9)
    last, per_row, scale_cols = tl.load(row + 10) * LAST_DIV, tl.load(row + 11), tl.load(row + 12)
    bad = _differing(
        main, codes, scales, phase_ptr, chunk, start, lo, count, n, mod, step, last, per_row, scale_cols,
        rcp, ROUND_BF16, BLOCKS, LAST_DIV == 32,
    )  # fmt: skip
    tl.atomic_add(flag_ptr + flag, bad, mask=bad != 0)  # adding 0 would queue on one address


@triton.jit
def _differing(
    main_ptr,
    codes_ptr,
    scales_ptr,
    phase_ptr,
    chunk,
    start,
    lo,
    count,
    n,
    mod,
    step,
    last,
    per_row,
    scale_cols,
    rcp,
    ROUND_BF16: tl.constexpr,  # noqa: N803
    BLOCKS: tl.constexpr,  # noqa: N803
    WHOLE: tl.constexpr,  # noqa: N803 - every row is whole blocks
):
    # Differing bytes of chunk ``chunk`` (BLOCKS sampled blocks) of one param: element ``i`` of
    # the param at ``main_ptr[i]``, its codes at ``codes_ptr[i]``.
    # The sampled phase is data: the first block of the slice's ``n`` is the phase modulo
    # ``mod``; indices past that phase's last block (at most the slice's last one) are masked.
    first = tl.load(phase_ptr) % mod
    b = chunk * BLOCKS + tl.arange(0, BLOCKS)
    i = lo + b.to(tl.int64)
    live = (b < count) & (i < (n - first + step - 1) // step)
    g = start + first + i * step  # global block id: row * per_row + column
    lane = tl.arange(0, 32)
    row = g // per_row
    col = g - row * per_row
    if WHOLE:  # whole-block rows: block g holds elements 32 g .. 32 g + 31
        inside = live[:, None] & (lane < 32)[None, :]
        at = (g * 32)[:, None] + lane[None, :]
    else:  # a row's last block is short: its missing lanes read as zeros
        inside = live[:, None] & ((col * 32)[:, None] + lane[None, :] < last)
        at = (row * last + col * 32)[:, None] + lane[None, :]
    x = tl.load(main_ptr + at, mask=inside, other=0.0).to(tl.float32)
    xi = x.to(tl.int32, bitcast=True)
    nan = (xi & 0x7FFFFFFF) > 0x7F800000
    if ROUND_BF16:  # to nearest even on the bits (NaN kept as it is)
        r = (xi + 0x7FFF + ((xi >> 16) & 1)) & -65536
        x = tl.where(nan, x, r.to(tl.float32, bitcast=True))
    # E8M0 exponent: amax of the non-NaN |x| times fp32(1/448), rounded up to a power of two.
    amax = tl.max(tl.where(nan, 0.0, tl.abs(x)), axis=1)
    p = (amax * rcp).to(tl.int32, bitcast=True)
    ex = p >> 23
    mn = p & 0x7FFFFF
    up = (mn > 0) & ((ex != 0) | (mn > 0x400000))
    e = tl.minimum(ex + up.to(tl.int32), 254)
    mult = tl.where(e == 0, 1.0, ((254 - e) << 23).to(tl.float32, bitcast=True))
    y = x * mult[:, None]
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # NaN stays NaN
    # E4M3 (fn) to nearest even: three mantissa bits from 2**-6 up, multiples of 2**-9 below.
    yi = y.to(tl.int32, bitcast=True)
    sign = (yi >> 24) & 0x80
    a = yi & 0x7FFFFFFF
    rn = (a + 0x7FFFF + ((a >> 20) & 1)) & 0x7FF00000
    normal = ((((rn >> 23) - 120) << 3) | ((rn >> 20) & 7)) & 0x7F
    q = tl.where(a < 0x3C800000, tl.abs(y), 0.0) * 512.0  # subnormal range only (no NaN to int)
    sub = ((q + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(a > 0x7F800000, 0x7F, mag) | sign
    got = tl.load(codes_ptr + at, mask=inside, other=0).to(tl.int32)
    # NaN on both sides is equal whatever its sign (conversions to bf16 differ in the NaN they
    # make): the check judges currency, not finiteness.
    both_nan = ((code & 0x7F) == 0x7F) & ((got & 0x7F) == 0x7F)
    bad = tl.sum((inside & (code != got) & ~both_nan).to(tl.int32), axis=1)
    s = tl.load(scales_ptr + row * scale_cols + col, mask=live, other=0).to(tl.int32)
    bad += (live & (s != e)).to(tl.int32)
    return tl.sum(bad, axis=0)


#: Not specialized on the integers: Triton would compile a kernel per combination of values it
#: sees (a step of 1, offsets divisible by 16), each a second or two at a job's first check. What
#: alignment needs is passed as the constexpr divisors instead: a few compiles per job.
kernel = triton.jit(
    _te_cast_compare,
    do_not_specialize=[
        "flag",
        "base_q",
        "start",
        "lo",
        "count",
        "n",
        "mod",
        "step",
        "last_q",
        "per_row",
        "scale_cols",
    ],
)

#: One launch per batch (the items' geometry is data): nothing to specialize.
items_kernel = triton.jit(_te_cast_compare_items, do_not_specialize=["flag", "rows"])
