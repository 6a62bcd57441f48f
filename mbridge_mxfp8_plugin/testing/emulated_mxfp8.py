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
MX spec's ``floor(log2(amax)) - 8``), from the package's leaf module
:mod:`mbridge_mxfp8_plugin.common.mxfp8_cast`, which states the rule and which the kit's TE-shaped param
writes through too; re-exported here.

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

Which emulation a harness gets: :func:`make_mxfp8_param`, :func:`emulated_mxfp8` and
:func:`mxfp8_reference_weight` read ``MXFP8_PARAM_KIND`` at call time: ``values`` (default, this
module's type) or ``te`` (:mod:`.te_mxfp8`, bytes and scales in both directions, the shape of
Transformer Engine's tensor), so the same tests run against either.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..common.mxfp8_cast import mxfp8_cast, mxfp8_quantize
from ._registry import registered_in_fp8_utils
from .te_mxfp8 import TEShapedMXFP8Quantizer, make_te_mxfp8_param, te_shaped_mxfp8

__all__ = [
    "EmulatedMXFP8Tensor",
    "EmulatedQuantizedTensor",
    "emulated_mxfp8",
    "PARAM_KIND_ENV",
    "make_mxfp8_param",
    "mxfp8_cast",
    "mxfp8_quantize",
    "mxfp8_reference_weight",
    "param_kind",
]

PARAM_KIND_ENV = "MXFP8_PARAM_KIND"
_KINDS = ("values", "te")


def param_kind() -> str:
    """The emulation the kit builds: ``MXFP8_PARAM_KIND`` = ``values`` (default) or ``te``."""
    kind = os.environ.get(PARAM_KIND_ENV, "").strip().lower() or "values"
    if kind not in _KINDS:
        raise ValueError(
            f"{PARAM_KIND_ENV}={os.environ[PARAM_KIND_ENV]!r} is not an MXFP8 param kind: "
            "set it to 'values' (the default) or 'te'"
        )
    return kind


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

    def get_high_precision_init_val(self) -> torch.Tensor | None:
        # None once cleared, as TE's: megatron-core main asks again after its optimizers cleared it.
        return self.__dict__.get("_high_precision_init_val")

    def clear_high_precision_init_val(self) -> None:
        self.__dict__.pop("_high_precision_init_val", None)


def make_mxfp8_param(init_values: torch.Tensor) -> torch.nn.Parameter:
    """A trainable emulated-MXFP8 parameter initialised from ``init_values`` (kept for the optimizer),
    of the kind :func:`param_kind` selects."""
    if param_kind() == "te":
        return make_te_mxfp8_param(init_values)
    init = init_values.detach().to(torch.bfloat16)
    storage = mxfp8_quantize(init).to(torch.bfloat16)
    tensor = storage.as_subclass(EmulatedMXFP8Tensor)
    param = torch.nn.Parameter(tensor, requires_grad=True)
    # __dict__ survives Parameter's detach(); TE keeps the same attribute on its params.
    param.__dict__["_high_precision_init_val"] = init.clone()
    return param


@contextlib.contextmanager
def emulated_mxfp8() -> Iterator[None]:
    """Register the emulated classes in ``megatron.core.fp8_utils`` (reversible).

    ``is_float8tensor``/``is_mxfp8tensor`` read these globals at call time, so every module that
    imported those functions sees the emulation. Registers the classes of :func:`param_kind`.
    """
    if param_kind() == "te":
        with te_shaped_mxfp8():
            yield
        return
    with registered_in_fp8_utils(EmulatedQuantizedTensor, EmulatedMXFP8Tensor):
        yield


def mxfp8_reference_weight(weight: torch.Tensor) -> torch.Tensor:
    """What a reference run (bf16 weights, MXFP8 rounding on the fly, no fp8 param gather) computes
    with, so that it sees exactly the values the MXFP8 run of :func:`param_kind` sees.

    ``values``: the row-wise values, straight-through for the gradient. ``te``: a TE-shaped tensor
    quantized from ``weight`` (the forward GEMM reads the row-wise copy, the grad-input GEMM the
    column-wise one; the gradient passes through the cast unchanged, as in TE).
    """
    if param_kind() == "te":
        return TEShapedMXFP8Quantizer(rowwise=True, columnwise=True)(weight)
    q = mxfp8_quantize(weight).to(weight.dtype)
    return weight + (q - weight).detach()
