"""Transformer Engine's MXFP8 cast (row-wise and column-wise), as pure tensor functions (torch only).

A leaf of the package so that both of the test kit's MXFP8 params (the values-holding
:mod:`mbridge_mxfp8_plugin.testing.emulated_mxfp8`, which re-exports it, and the TE-shaped
:mod:`mbridge_mxfp8_plugin.testing.te_mxfp8`) write through one function and cannot drift, and so
that the weight verifier can read the block geometry (:data:`MXFP8_BLOCK`) without importing the
kit; the verifier's reference itself is each param type's own write path.
tests/unit/test_mxfp8_cast.py pins the rule on crafted blocks worked out from TE's kernel behaviour.

The rule, per block of 32 consecutive elements along the last dimension:

* ``amax`` is the largest ``|x|`` of the block's non-NaN elements (TE reduces with ``fmaxf``,
  which drops NaN);
* the biased E8M0 exponent ``e`` is ``amax * fp32(1/448)`` (one fp32 product, round to nearest)
  rounded *up* to a power of two: the fp32 exponent field, plus one if any mantissa bit is set,
  except that a product at or below 2**-127 gives 0 and nothing rounds past 254 (an infinite
  amax gives 254). This is TE's software path (pre-Blackwell), written to match Blackwell's
  ``cvt.rp.satfinite.ue8m0x2``; IEEE subnormal products are kept, so a build that flushes them
  would differ only for amax below ``448 * 2**-126`` (about 1e-35). It is not the OCP MX spec's
  ``floor(log2(amax)) - 8``, which saturates the largest element of blocks whose amax mantissa
  exceeds 1.75 where TE picks the next scale up;
* each element is ``fp8_e4m3(x * m)``, round-to-nearest-even, saturating at +-448, with
  ``m = 2**(127 - e)``, except ``m = 1`` for ``e == 0`` (an all-zero block keeps its zeros; a
  block with amax <= ``448 * 2**-127`` is flushed to zeros) and ``m = 0`` for ``e == 254``
  (current TE's bit trick; finite elements become 0, infinite ones NaN). NaN elements stay NaN;
* the value is ``element * 2**(e - 127)`` (0 for ``e == 0``). For finite inputs the round-up
  keeps every ``|x * m|`` at or below 448, so saturation only matters for non-finite inputs.

Last dimensions that are not a multiple of 32 (TE refuses them) are zero-padded, which leaves
amax unchanged.

The column-wise copy (what TE's backward GEMMs read for the weight, produced by the same kernel
from the same input) is the same rule applied to blocks of 32 consecutive *rows* of each column
of the tensor flattened to 2-D ``(prod(shape[:-1]), shape[-1])``: :func:`mxfp8_cast_columnwise`,
scales shaped ``(ceil(rows / 32), last)``. :func:`mxfp8_decode` turns codes and scales (either
direction, unpadded or padded to TE's tiles) back into values. No scale swizzling, no E5M2.
"""

from __future__ import annotations

import torch

__all__ = ["MXFP8_BLOCK", "mxfp8_cast", "mxfp8_cast_columnwise", "mxfp8_decode", "mxfp8_quantize"]

MXFP8_BLOCK = 32
_E4M3_MAX = 448.0
_FP32_MANT_BITS = 23
_FP32_MANT_MASK = (1 << _FP32_MANT_BITS) - 1
_E8M0_MAX = 254  # 255 is E8M0's NaN
# TE's Quantized_Limits<fp8e4m3>::max_norm_rcp: 1/448 rounded to fp32 (slightly above 1/448).
_MAX_NORM_RCP = torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32).item()


def _blocks(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp32 view of ``values`` as (rows, blocks, 32), zero-padded; also the unpadded last dim."""
    x = values.detach().float()
    last = x.shape[-1] if x.dim() > 0 else 1
    rows = x.reshape(-1, last)
    pad = (-last) % MXFP8_BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, MXFP8_BLOCK), last


def _e8m0(blocks: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent per block (int32, keepdim), by TE's ``float_to_e8m0`` rule."""
    # NaN elements do not count (TE reduces with fmaxf); in place on the |x| temporary, and no
    # data-dependent branch, which would cost a host sync per param on a GPU.
    amax = blocks.abs().nan_to_num_(nan=0.0, posinf=float("inf")).amax(dim=-1, keepdim=True)
    bits = (amax * _MAX_NORM_RCP).view(torch.int32)  # amax >= 0: the sign bit is clear
    exponent = bits >> _FP32_MANT_BITS
    mantissa = bits & _FP32_MANT_MASK
    # Round up, except: a product <= 2**-127 (subnormal, mantissa <= half) stays at 0, and
    # 254 is the satfinite ceiling; an infinite product (field 255) is clamped to 254.
    round_up = (mantissa > 0) & ~((exponent == 0) & (mantissa <= (1 << (_FP32_MANT_BITS - 1))))
    return (exponent + round_up.to(torch.int32)).clamp_(max=_E8M0_MAX)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2**(biased - 127) in fp32 for biased exponents 0..254 (0.0 for 0, like TE's ``exp2f``)."""
    return (biased << _FP32_MANT_BITS).view(torch.float32)


def _cast_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exponent = _e8m0(blocks)
    # TE's exp2f_rcp: 1 for e == 0, else the fp32 with exponent field 254 - e (0.0 at e == 254).
    multiplier = torch.where(exponent == 0, 1.0, _pow2(_E8M0_MAX - exponent))
    scaled = (blocks * multiplier).clamp_(-_E4M3_MAX, _E4M3_MAX)  # satfinite; NaN stays NaN
    return scaled.to(torch.float8_e4m3fn), exponent


def mxfp8_cast(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's rowwise MXFP8 cast of ``values``: ``(elements, exponents)``.

    ``elements`` is ``float8_e4m3fn`` with the shape of ``values``; ``exponents`` holds the biased
    E8M0 byte of each 32-element block of the last dimension (uint8, shape
    ``values.shape[:-1] + (ceil(last / 32),)``), unpadded and unswizzled. See the module docstring.
    """
    blocks, last = _blocks(values)
    elements, exponent = _cast_blocks(blocks)
    shape = values.shape
    elements = elements.reshape(blocks.shape[0], -1)[:, :last].reshape(shape)
    lead = shape[:-1] if len(shape) else ()
    return elements, exponent.to(torch.uint8).reshape(*lead, blocks.shape[1])


def _as_rows(values: torch.Tensor) -> torch.Tensor:
    """The 2-D ``(prod(shape[:-1]), shape[-1])`` view TE's kernels see."""
    last = values.shape[-1] if values.dim() > 0 else 1
    return values.reshape(-1, last)


def mxfp8_cast_columnwise(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's column-wise MXFP8 cast of ``values``: ``(elements, exponents)``.

    Blocks are 32 consecutive rows of one column of the 2-D view (a first dimension that is not a
    multiple of 32 is zero-padded, like the row-wise cast's last dimension). ``elements`` has the
    shape of ``values``; ``exponents`` is uint8 ``(ceil(rows / 32), last)``, unpadded.
    """
    rows = _as_rows(values)
    elements, exponents = mxfp8_cast(rows.t())  # the row-wise rule on the transpose
    return elements.t().reshape(values.shape), exponents.t().contiguous()


def mxfp8_decode(codes: torch.Tensor, exponents: torch.Tensor, *, columnwise: bool = False) -> torch.Tensor:
    """fp32 values of MXFP8 ``codes`` (``float8_e4m3fn``, or their uint8 bytes) and E8M0
    ``exponents`` (uint8), by TE's dequantization: ``element * 2**(e - 127)``, 0 for ``e == 0``.

    ``exponents`` may carry TE's tile padding (rows and columns beyond the blocks): it is cropped.
    """
    elements = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
    rows = _as_rows(elements).float()
    n, last = rows.shape
    if columnwise:
        scale = exponents[: -(-n // MXFP8_BLOCK), :last].to(torch.int32)
        scale = _pow2(scale).repeat_interleave(MXFP8_BLOCK, dim=0)[:n]
    else:
        scale = exponents[:n, : -(-last // MXFP8_BLOCK)].to(torch.int32)
        scale = _pow2(scale).repeat_interleave(MXFP8_BLOCK, dim=1)[:, :last]
    return (rows * scale).reshape(codes.shape)


def mxfp8_quantize(values: torch.Tensor, *, columnwise: bool = False) -> torch.Tensor:
    """Round ``values`` onto the MXFP8 grid as TE's rowwise cast does; returns the fp32 values.

    Used both by the emulated param's writes and by the reference runs' on-the-fly
    quantization, so the two runs see bit-identical weights. ``columnwise=True``: the values of
    TE's column-wise copy instead (:func:`mxfp8_cast_columnwise`).
    """
    if columnwise:
        return mxfp8_decode(*mxfp8_cast_columnwise(values), columnwise=True)
    blocks, last = _blocks(values)
    elements, exponent = _cast_blocks(blocks)
    q = elements.float().mul_(_pow2(exponent))
    return q.reshape(blocks.shape[0], -1)[:, :last].reshape(values.shape)
