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

Numerics follow the OCP MX spec: blocks of 32 consecutive elements along the last dimension
share one E8M0 (power-of-two) scale, elements are E4M3 (round-to-nearest-even, saturating at
448). The storage keeps the *dequantized* values in bf16 (exact: E4M3 x 2^k fits bf16), so the
bytes differ from TE's uint8 + scale layout but every value megatron-core can observe is the one
real MXFP8 produces.
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
    "mxfp8_quantize",
]

MXFP8_BLOCK = 32
_E4M3_MAX = 448.0
_E4M3_EMAX = 8  # exponent of the largest normal E4M3 value (448 = 1.75 * 2**8)


def mxfp8_quantize(values: torch.Tensor) -> torch.Tensor:
    """Round ``values`` onto the MXFP8 grid (1x32 blocks along the last dim); returns fp32.

    Used both by the emulated param's writes and by the reference run's on-the-fly
    quantization, so the two runs see bit-identical weights.
    """
    x = values.detach().float()
    shape = x.shape
    last = shape[-1] if x.dim() > 0 else 1
    rows = x.reshape(-1, last)
    pad = (-last) % MXFP8_BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    blocks = rows.reshape(rows.shape[0], -1, MXFP8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # Shared exponent per the OCP MX spec: floor(log2(amax)) - emax(E4M3); E8M0 has no zero,
    # an all-zero block gets scale 2**-127 which leaves its zeros untouched.
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - _E4M3_EMAX
    scale = torch.exp2(exponent.clamp(-127, 127))
    scaled = (blocks / scale).clamp(-_E4M3_MAX, _E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).float() * scale
    q = q.reshape(rows.shape[0], -1)[:, :last]
    return q.reshape(shape)


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
