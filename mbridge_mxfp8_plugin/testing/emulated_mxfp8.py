"""An emulated MXFP8 parameter that megatron-core treats exactly like Transformer Engine's.

Transformer Engine cannot be installed on CPU hosts and real MXFP8 needs Blackwell GPUs, but
megatron-core never looks inside an MXFP8 tensor: it recognises one through the module globals
of ``megatron.core.fp8_utils`` (``FP8_TENSOR_CLASS``/``MXFP8Tensor`` and their ``HAVE_*``
flags) and relies on four behaviours, all reproduced here:

* ``param.dtype`` reports the high-precision "fake" dtype (bf16) while the param is quantized,
  so the distributed optimizer files it with the bf16 params and builds an fp32 main param;
* ``param.data.copy_(bf16_values)`` quantizes (this is the write-back after the all-gather);
* ``get_high_precision_init_val()`` / ``clear_high_precision_init_val()`` give the optimizer
  the unquantized init values (TE does this under fp8 model init);
* autograd treats it as a leaf whose forward value is the dequantized tensor.

Numerics: Transformer Engine's rowwise E4M3 MXFP8 cast (its ``float_to_e8m0`` rule, not the OCP
MX spec's ``floor(log2(amax)) - 8``, which saturates the largest element of blocks whose amax
mantissa exceeds 1.75 where TE picks the next scale up). Per block of 32 consecutive elements
along the last dimension:

* ``amax`` is the largest ``|x|`` of the block's non-NaN elements (TE reduces with ``fmaxf``,
  which drops NaN);
* the biased E8M0 exponent ``e`` is ``amax * fp32(1/448)`` (one fp32 product, round to nearest)
  rounded *up* to a power of two: the fp32 exponent field, plus one if any mantissa bit is set,
  except that a product at or below 2**-127 gives 0 and nothing rounds past 254 (an infinite
  amax gives 254). This is TE's software path (pre-Blackwell), written to match Blackwell's
  ``cvt.rp.satfinite.ue8m0x2``; IEEE subnormal products are kept, so a build that flushes them
  would differ only for amax below ``448 * 2**-126`` (about 1e-35);
* each element is ``fp8_e4m3(x * m)``, round-to-nearest-even, saturating at +-448, with
  ``m = 2**(127 - e)``, except ``m = 1`` for ``e == 0`` (an all-zero block keeps its zeros; a
  block with amax <= ``448 * 2**-127`` is flushed to zeros) and ``m = 0`` for ``e == 254``
  (current TE's bit trick; finite elements become 0, infinite ones NaN). NaN elements stay NaN;
* the value is ``element * 2**(e - 127)`` (0 for ``e == 0``). For finite inputs the round-up
  keeps every ``|x * m|`` at or below 448, so saturation only matters for non-finite inputs.

:func:`mxfp8_cast` returns the E4M3 elements and the E8M0 exponent bytes, :func:`mxfp8_quantize`
the values. What is *not* emulated: TE's columnwise copy (32x1 blocks down the first dimension,
which TE uses for the weight in the backward GEMMs: here backward sees the rowwise values too);
the scale-inverse storage (TE pads it to 128x4 tiles and may swizzle it for the GEMM; here one
unpadded byte per block); E5M2; last dimensions that are not a multiple of 32 (TE refuses them,
the kit zero-pads, which leaves amax unchanged); the fused cast+activation kernels. The param
stores the *values* in bf16, not TE's uint8 + scale bytes: exact whenever the block's scale is
at least 2**-124 (an E4M3 subnormal times a smaller scale is below bf16's subnormal step), so
every value megatron-core reads from the param equals the rowwise value real MXFP8 produces.

Re-quantizing dequantized values (what a checkpoint load does: checkpoints hold bf16) keeps the
values but not always the bytes: a block whose dequantized max is at most ``224 * s`` comes back
with scale ``s / 2`` and doubled codes, in TE as here. The param keeps values only, so a load
through ``copy_`` gives TE's values, and :func:`mxfp8_cast` gives TE's bytes for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "EmulatedMXFP8Tensor",
    "EmulatedQuantizedTensor",
    "emulated_mxfp8",
    "make_mxfp8_param",
    "mxfp8_cast",
    "mxfp8_quantize",
]

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


def mxfp8_quantize(values: torch.Tensor) -> torch.Tensor:
    """Round ``values`` onto the MXFP8 grid as TE's rowwise cast does; returns the fp32 values.

    Used both by the emulated param's writes and by the reference runs' on-the-fly
    quantization, so the two runs see bit-identical weights.
    """
    blocks, last = _blocks(values)
    elements, exponent = _cast_blocks(blocks)
    q = elements.float().mul_(_pow2(exponent))
    return q.reshape(blocks.shape[0], -1)[:, :last].reshape(values.shape)


class EmulatedQuantizedTensor(torch.Tensor):
    """Stands in for TE's ``QuantizedTensor`` base class (``fp8_utils.FP8_TENSOR_CLASS``)."""

    _KEEP_SUBCLASS = frozenset(
        {
            torch.Tensor.data.__get__,  # type: ignore[attr-defined]
            torch.Tensor.detach,
            torch.Tensor.detach_,
            torch.Tensor.requires_grad_,
        }
    )

    def quantize_(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], EmulatedQuantizedTensor):
            dst, src = args[0], args[1]
            dst.quantize_(src)
            return dst
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in cls._KEEP_SUBCLASS and type(out) is torch.Tensor:
            return out.as_subclass(cls)
        return out


class EmulatedMXFP8Tensor(EmulatedQuantizedTensor):
    """Stands in for TE's ``MXFP8Tensor`` (``fp8_utils.MXFP8Tensor``). See the module docstring."""

    def quantize_(self, values: torch.Tensor) -> None:
        q = mxfp8_quantize(values.reshape(self.shape)).to(torch.bfloat16)
        with torch._C.DisableTorchFunctionSubclass():
            torch.Tensor.copy_(self, q)

    def dequantize(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.clone(self)

    def get_high_precision_init_val(self) -> torch.Tensor:
        return self.__dict__["_high_precision_init_val"]

    def clear_high_precision_init_val(self) -> None:
        self.__dict__.pop("_high_precision_init_val", None)


def make_mxfp8_param(init_values: torch.Tensor) -> torch.nn.Parameter:
    """A trainable emulated-MXFP8 parameter initialised from ``init_values`` (kept for the optimizer)."""
    init = init_values.detach().to(torch.bfloat16)
    storage = mxfp8_quantize(init).to(torch.bfloat16)
    tensor = storage.as_subclass(EmulatedMXFP8Tensor)
    param = torch.nn.Parameter(tensor, requires_grad=True)
    # __dict__ survives Parameter's detach(); TE keeps the same attribute on its params.
    param.__dict__["_high_precision_init_val"] = init.clone()
    return param


_GLOBALS = ("HAVE_TE_FP8_TENSOR_CLASS", "FP8_TENSOR_CLASS", "HAVE_TE_MXFP8TENSOR", "MXFP8Tensor")


@contextlib.contextmanager
def emulated_mxfp8() -> Iterator[None]:
    """Register the emulated classes in ``megatron.core.fp8_utils`` (reversible).

    ``is_float8tensor``/``is_mxfp8tensor`` read these globals at call time, so every module that
    imported those functions sees the emulation.
    """
    from megatron.core import fp8_utils

    saved: dict[str, Any] = {name: getattr(fp8_utils, name, None) for name in _GLOBALS}
    fp8_utils.HAVE_TE_FP8_TENSOR_CLASS = True
    fp8_utils.FP8_TENSOR_CLASS = EmulatedQuantizedTensor
    fp8_utils.HAVE_TE_MXFP8TENSOR = True
    fp8_utils.MXFP8Tensor = EmulatedMXFP8Tensor
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(fp8_utils, name, value)
