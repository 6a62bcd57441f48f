"""The MXFP8 cast (common/mxfp8_cast.py, which the emulated MXFP8 tensor quantizes with) quantizes the
way Transformer Engine's rowwise E4M3 cast does (see the module docstring). The emulated tensor itself:
tests/unit/test_emulated_mxfp8.py.

The crafted cases carry values worked out by hand from TE's rule (as mbridge_mxfp8_plugin/common/mxfp8_cast.py
states it), with the arithmetic in the comments; the random test compares against a scalar reference
written from the same rule with exact arithmetic, not from the vectorised code under test.
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_cast, mxfp8_quantize

FP32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]  # (2 - 2**-23) * 2**127
FP32_1E38 = struct.unpack("<f", struct.pack("<f", 1e38))[0]


def _e4m3_grid() -> list[float]:
    """All finite non-negative E4M3 values in code order (bias 7), from the format definition."""
    values = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN encoding
            values.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    assert values == sorted(values) and values[-1] == 448.0
    return values


GRID = _e4m3_grid()
GRID_Q = [Fraction(g) for g in GRID]


def _fp32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _fp32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _te_block(block: list[float]) -> tuple[list[float], int]:
    """TE's rule for one block, scalar and exact: (dequantized values, biased E8M0 byte)."""
    amax = max((abs(v) for v in block if not math.isnan(v)), default=0.0)
    # One fp32 product, rounded to nearest (exact in double first: 24 x 24 bits < 53).
    bits = _fp32_bits(_fp32(amax * _fp32(1 / 448)))
    field, mantissa = bits >> 23, bits & 0x7FFFFF
    if field == 255:
        e = 254
    elif mantissa and field != 254 and not (field == 0 and mantissa <= 0x400000):
        e = field + 1
    else:
        e = field
    multiplier = 1.0 if e == 0 else (0.0 if e == 254 else 2.0 ** (127 - e))
    scale = 0.0 if e == 0 else 2.0 ** (e - 127)
    out = []
    for v in block:
        y = v * multiplier
        if math.isnan(y):
            out.append(math.nan)
            continue
        mag = min(Fraction(abs(y)), Fraction(448)) if math.isfinite(y) else Fraction(448)
        i = bisect.bisect_left(GRID_Q, mag)
        if i < len(GRID_Q) and GRID_Q[i] == mag:
            code = i
        else:  # between codes i-1 and i: nearest, ties to the even code (even mantissa)
            lo, hi = mag - GRID_Q[i - 1], GRID_Q[i] - mag
            code = i - 1 if lo < hi or (lo == hi and (i - 1) % 2 == 0) else i
        out.append(math.copysign(GRID[code], y) * scale)
    return out, e


def _block(*head: float) -> torch.Tensor:
    """One 32-element fp32 block: ``head`` then zeros."""
    return torch.tensor(list(head) + [0.0] * (32 - len(head)), dtype=torch.float32)


# (name, block head, E8M0 byte, dequantized head), each worked out by hand from TE's rule.
# fp32(1/448) = 0x3B124925 is 1/448 + 1.0e-10, so 448 * fp32(1/448) = 1 + 4.5e-8, which rounds
# to exactly 1.0 in fp32 (half an ulp of 1 is 6.0e-8).
HAND_CASES = [
    # amax 448: product exactly 1.0 = 2**0, no mantissa -> e = 127, multiplier 1.
    ("amax_448", (448.0, 1.0, -0.5), 127, (448.0, 1.0, -0.5)),
    # amax 449: product 1.0022 has mantissa bits -> e = 128, multiplier 1/2: 449/2 = 224.5 lies
    # between E4M3 224 and 240 -> 224 -> 448; -449 likewise; 3 -> 1.5 exact -> 3.
    ("amax_449", (449.0, -449.0, 3.0), 128, (448.0, -448.0, 3.0)),
    # amax 15 = 1.875 * 2**3 (mantissa above 1.75): 15 * fp32(1/448) = 1.07 * 2**-5, field 122
    # with mantissa -> e = 123, multiplier 16: 15 -> 240 exact -> 15; 14.5 -> 232, a tie between
    # 224 (mantissa 110, even) and 240 (111) -> 224 -> 14; 14.75 -> 236 -> 240 -> 15; -1 -> -16.
    # The OCP floor rule gives scale 2**-5 instead: 15 -> 480 saturates to 448 -> 14.
    ("amax_1.875x2^3", (15.0, 14.5, 14.75, -1.0), 123, (15.0, 14.0, 15.0, -1.0)),
    # amax 14 = 1.75 * 2**3: product 2**-5 exactly -> e = 122, multiplier 32: 14 -> 448;
    # fp32(0.1) * 32 = 3.2000000477 -> E4M3 3.25 (step 0.25 in [2, 4)) -> 3.25/32 = 0.1015625.
    ("amax_1.75x2^3", (14.0, 0.1), 122, (14.0, 0.1015625)),
    # all-negative block, amax 15 again -> e = 123: -15 -> -240 -> -15; -0.03125 -> -0.5 -> exact.
    ("negative", (-15.0, -0.03125), 123, (-15.0, -0.03125)),
    # all zeros: amax 0 -> product 0 -> e = 0 (what TE stores), multiplier 1, elements 0.
    ("zero_block", (), 0, ()),
    # amax 2**-120: product 1.7e-39 is an fp32 subnormal at or below 2**-127 (mantissa
    # 0x124925 <= 0x400000) -> e = 0, multiplier 1: 2**-120 -> E4M3 0. TE flushes the block.
    ("tiny_flushed", (2.0**-120, -(2.0**-121)), 0, (0.0, 0.0)),
    # amax 448 * 2**-127 = 1.75 * 2**-119: product exactly 2**-127 (the 4.5e-8 excess is below
    # half a subnormal ulp) -> mantissa 0x400000 -> e = 0 -> flushed.
    ("tiny_boundary", (1.75 * 2.0**-119,), 0, (0.0,)),
    # amax 2**-118: product 6.7e-39, subnormal above 2**-127 (mantissa 0x492492) -> rounds up to
    # 2**-126, e = 1, multiplier 2**126: 2**-118 -> 256, 2**-119 -> 128, both exact.
    ("tiny_kept", (2.0**-118, 2.0**-119), 1, (2.0**-118, 2.0**-119)),
    # amax fp32(1e38) = 9.99999968e37: product 2.23e35 = 1.34 * 2**117 -> e = 127 + 118 = 245,
    # multiplier 2**-118: 300.9 -> E4M3 288 (step 32 in [256, 512); 320 is 19 away, 288 is 13).
    ("huge", (FP32_1E38,), 245, (288.0 * 2.0**118,)),
    # amax = fp32 max: product 7.6e35, field 246 with mantissa -> e = 247, multiplier 2**-120:
    # 255.99998 -> E4M3 256 -> 256 * 2**120 = 2**128, which overflows fp32 to inf; 1 -> 2**-120 -> 0.
    # (A finite amax never reaches the 254 clamp: the largest e is 247.)
    ("fp32_max", (FP32_MAX, 1.0), 247, (math.inf, 0.0)),
    # RNE ties with multiplier 1 (amax 448, e = 127): 17 sits between 16 (mantissa 000) and 18
    # (001) -> 16; 19 between 18 and 20 (010) -> 20; -17 -> -16; 3 * 2**-10 between subnormal
    # codes 1 (2**-9) and 2 (2**-8) -> 2**-8; 2**-10 between 0 and 2**-9 -> 0; 5 * 2**-10
    # between codes 2 (4 * 2**-10) and 3 (6 * 2**-10) -> 2**-8.
    (
        "rne_ties",
        (448.0, 17.0, 19.0, -17.0, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10),
        127,
        (448.0, 16.0, 20.0, -16.0, 2.0**-8, 0.0, 2.0**-8),
    ),
    # NaN elements do not enter amax (TE reduces with fmaxf) and stay NaN: as "amax_449".
    ("nan_element", (math.nan, 449.0, 3.0), 128, (math.nan, 448.0, 3.0)),
    # An infinite amax: TE's float_to_e8m0 gives 0xFE (the 254 clamp); the multiplier at 254 is
    # 0 in current TE and 2**-127 in older releases: either way 1 and -2 become 0.
    ("inf_amax", (math.inf, 1.0, -2.0), 254, (None, 0.0, 0.0)),
]


@pytest.mark.parametrize(("head", "want"), [(c[1], c[3]) for c in HAND_CASES], ids=[c[0] for c in HAND_CASES])
def test_quantized_values_follow_transformer_engines_rule(head, want):
    got = mxfp8_quantize(_block(*head))
    for i, w in enumerate(want):
        if w is not None:
            assert got[i].item() == w or (math.isnan(w) and math.isnan(got[i].item())), (i, got[i].item(), w)
    assert torch.all(got[len(want) :] == 0)


@pytest.mark.parametrize(("head", "byte"), [(c[1], c[2]) for c in HAND_CASES], ids=[c[0] for c in HAND_CASES])
def test_e8m0_exponent_bytes_follow_transformer_engines_rule(head, byte):
    elements, exponents = mxfp8_cast(_block(*head))
    assert elements.dtype == torch.float8_e4m3fn and elements.shape == (32,)
    assert exponents.dtype == torch.uint8 and exponents.tolist() == [byte]


def test_cast_elements_and_layout():
    # The "amax_1.875x2^3" case as codes: 240, 224, 240, -16 (see HAND_CASES); a 2 x 40 input has
    # two blocks per row (the second zero-padded), one byte each.
    elements, _ = mxfp8_cast(_block(15.0, 14.5, 14.75, -1.0))
    assert elements[:4].float().tolist() == [240.0, 224.0, 240.0, -16.0]
    x = torch.zeros(2, 40)
    x[0, 0], x[0, 35], x[1, 39] = 448.0, 449.0, 14.0
    elements, exponents = mxfp8_cast(x)
    assert elements.shape == (2, 40) and exponents.tolist() == [[127, 128], [0, 122]]
    assert mxfp8_quantize(x)[0, 35].item() == 448.0


def test_requantizing_dequantized_values_halves_the_scale_but_keeps_values():
    # emulated_mxfp8's docstring: a block whose dequantized max is <= 224 * s comes back with
    # scale s/2. "amax_449" has s = 2 (e = 128) and dequantized max 448 = 224 * s;
    # 448 * fp32(1/448) = 1.0 -> e = 127.
    first = mxfp8_quantize(_block(449.0, -449.0, 3.0))
    elements, exponents = mxfp8_cast(first)
    assert exponents.tolist() == [127]
    assert elements[:3].float().tolist() == [448.0, -448.0, 3.0]  # were 224, -224, 1.5 at e = 128
    assert torch.equal(mxfp8_quantize(first), first)


def test_matches_a_scalar_reference_over_the_whole_exponent_range():
    gen = torch.Generator().manual_seed(0)
    n = 96
    x = torch.randn(n, 32, generator=gen)
    # Block magnitudes from fp32 subnormal-product territory to near fp32 max; a few blocks with
    # amax mantissa in (1.75, 2), some zeros, a zero block and a NaN.
    exps = torch.randint(-135, 120, (n, 1), generator=gen).float()
    x = x * torch.exp2(exps)
    x[::7, 0] = 1.9 * torch.exp2(exps[::7, 0])
    x[::5, 3:9] = 0.0
    x[11] = 0.0
    x[13, 4] = math.nan
    got_values = mxfp8_quantize(x)
    _, got_bytes = mxfp8_cast(x)
    for r in range(n):
        want, byte = _te_block(x[r].tolist())
        assert got_bytes[r].tolist() == [byte], r
        for i, w in enumerate(want):
            g = got_values[r, i].item()
            assert g == w or (math.isnan(g) and math.isnan(w)), (r, i, g, w)


def test_differs_from_the_ocp_floor_rule_only_where_the_spec_saturates():
    # The OCP MX spec's scale (floor(log2 amax) - 8) and TE's agree unless the block's amax
    # mantissa exceeds 1.75: there the spec saturates the largest element at 448 and TE takes the
    # next scale up, coarser for the rest of the block (the issue measured about 0.5% of Gaussian
    # values differing).
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    blocks = x.reshape(-1, 8, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax)))
    ocp = (blocks / (scale / 256)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (scale / 256)
    te = mxfp8_quantize(x).reshape(blocks.shape)
    differ = te != ocp
    assert 0.002 < differ.float().mean().item() < 0.01
    assert not torch.any(differ & (amax / scale <= 1.75))
    at_max = blocks.abs() == amax  # TE is closer on the element the spec saturates
    assert torch.all((te - blocks).abs()[at_max] <= (ocp - blocks).abs()[at_max])


def test_quantize_is_idempotent_and_exact_in_bf16():
    x = torch.randn(3, 96)
    q = mxfp8_quantize(x)
    assert torch.equal(mxfp8_quantize(q), q)
    assert torch.equal(q.to(torch.bfloat16).float(), q)
