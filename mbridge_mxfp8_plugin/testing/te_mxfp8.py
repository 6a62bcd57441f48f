"""A TE-shaped MXFP8 parameter: bytes and scales in both directions, like Transformer Engine 2.x's.

The kit's other emulation (:mod:`.emulated_mxfp8`) stores an MXFP8 param's *values*. Transformer
Engine's ``MXFP8Tensor`` stores what its GEMMs read, and the code paths that depend on that
(a quantizer object, byte and scale buffers, a column-wise copy for the backward pass,
dequantize-on-save and re-quantize-on-load) never run without it. This type has that shape, so
megatron-core, Megatron-Bridge and the plugin take their Transformer Engine branches on CPU:

* a ``torch.Tensor`` wrapper subclass whose ``dtype`` is the nominal bf16 and whose own storage is
  empty; ``_rowwise_data`` / ``_columnwise_data`` (uint8 E4M3 codes, the param's shape),
  ``_rowwise_scale_inv`` (E8M0 bytes, one per 1x32 block, padded like TE to ``(128, 4)`` tiles)
  and ``_columnwise_scale_inv`` (one per 32x1 block down the flattened first dimension, padded to
  ``(4, 128)``), ``_fp8_dtype``, ``_quantizer``;
* ``_quantizer`` (:class:`TEShapedMXFP8Quantizer`): ``quantize`` (a new tensor; identity backward
  under autograd, as TE's), ``update_quantized(src, dst)``, ``copy``, ``set_usage``,
  ``rowwise_usage`` / ``columnwise_usage``, ``make_empty``, ``get_scale_shape``;
* ``dequantize(dtype=)``, ``quantize_``, ``float()`` / ``bfloat16()``, ``detach`` (an alias of the
  same buffers, which is what ``param.data`` returns), ``clone``, ``get_metadata``;
* ops dispatch as TE's ``__torch_dispatch__`` does: ``copy_`` into the tensor quantizes both
  directions from the source (megatron-core's write-back after the param all-gather, and a
  checkpoint load: loaded bf16 values are re-quantized, so ~5% of blocks change codes and scales
  and the column-wise copy is derived from dequantized row-wise values: defect F's mechanism);
  in-place ops dequantize, run and re-quantize; every other op runs on the dequantized row-wise
  values and returns a plain tensor (so ``.to()``/``.cpu()`` copies, what a checkpoint writes,
  are bf16, as with TE 2.x; TE's tensors live on the GPU, the kit's on the host, where a copy to
  the host would be a no-op: it dequantizes here too);
* under TE's fp8 model init a param carries ``get_high_precision_init_val`` /
  ``clear_high_precision_init_val`` (bound methods; the value is kept on CPU; after clearing,
  ``get`` returns None, as in TE).

Numerics: TE's rule bit for bit, from :mod:`mbridge_mxfp8_plugin.common.mxfp8_cast`, in both directions.

Which copy a GEMM reads. TE's GEMMs need the scaling blocks to run along the contraction
dimension: the forward ``x @ W.T`` reads the row-wise copy, the grad-input GEMM ``dy @ W`` the
column-wise one. Here ``aten.mm`` / ``aten.addmm`` pick the copy whose blocks run along the
contraction dimension of each MXFP8 operand, and ``W.t()`` returns a transposed view that keeps
the choice for the GEMM that consumes it. That covers megatron-core's local layers (forward
``matmul(x, W.t())``, backward ``grad.matmul(W)`` in its linear autograd function) and
``torch.nn.functional.linear`` (whose ``addmm`` backward transposes the saved ``W.t()`` back).
Any other op reads the row-wise values. The weight gradient does not read the weight.

NOT emulated: quantized activations and gradients (TE also casts the GEMMs' other operands to
MXFP8; here they stay bf16, and the GEMM is a bf16 matmul of exactly representable values, not
TE's FP8 kernel with fp32 accumulation); scale swizzling for the GEMM (``_with_gemm_swizzled_scales``
is always False); E5M2; TE's FSDP2 hooks, ``split``/``new_zeros``/``as_strided`` special cases and
pickling across TE versions; the contents of the scale tiles' padding (TE allocates it
uninitialised, the kit writes zeros: read scales as ``[:rows, :cols // 32]``); a first or last
dimension that is not a multiple of 32 (TE refuses it; the kit zero-pads the blocks).
"""

from __future__ import annotations

import contextlib
import enum
import math
import types
from collections.abc import Iterator
from typing import Any

import torch

from ..common.mxfp8_cast import MXFP8_BLOCK, mxfp8_cast, mxfp8_cast_columnwise, mxfp8_decode
from ._registry import registered_in_fp8_utils
from .te_quantized import TEShapedQuantizedTensor, _plain_values, _swaps_2d, _TransposedView

__all__ = [
    "DType",
    "TEShapedMXFP8Quantizer",
    "TEShapedMXFP8Tensor",
    "TEShapedQuantizedTensor",
    "make_te_mxfp8_param",
    "te_shaped_mxfp8",
]

aten = torch.ops.aten


class DType(enum.Enum):
    """Stands in for ``transformer_engine_torch.DType`` (only E4M3 is emulated)."""

    kFloat8E4M3 = 7


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class TEShapedMXFP8Quantizer:
    """Stands in for TE's ``MXFP8Quantizer``: builds and refills :class:`TEShapedMXFP8Tensor`."""

    def __init__(
        self, fp8_dtype: DType = DType.kFloat8E4M3, *, rowwise: bool = True, columnwise: bool = True
    ) -> None:
        if fp8_dtype is not DType.kFloat8E4M3:
            raise ValueError(f"fp8_dtype={fp8_dtype!r}: the TE-shaped MXFP8 emulation has E4M3 only")
        self.dtype = fp8_dtype
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False
        self.optimize_for_gemm = False
        self.with_2d_quantization = False

    def __repr__(self) -> str:
        return (
            f"TEShapedMXFP8Quantizer(rowwise_usage={self.rowwise_usage}, "
            f"columnwise_usage={self.columnwise_usage})"
        )

    def copy(self) -> TEShapedMXFP8Quantizer:
        q = TEShapedMXFP8Quantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        q.internal, q.optimize_for_gemm = self.internal, self.optimize_for_gemm
        return q

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def get_usages(self) -> dict[str, bool]:
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def get_scale_shape(self, shape: Any, columnwise: bool) -> tuple[int, int]:
        """TE's padded scale-inverse shape: row-wise ``(rows, cols/32)`` padded to ``(128, 4)``,
        column-wise ``(rows/32, cols)`` padded to ``(4, 128)`` (blocks rounded up here)."""
        shape = tuple(shape)
        rows, cols = math.prod(shape[:-1]), shape[-1]
        if columnwise:
            return _round_up(-(-rows // MXFP8_BLOCK), 4), _round_up(cols, 128)
        return _round_up(rows, 128), _round_up(-(-cols // MXFP8_BLOCK), 4)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        return (
            inp.dim() >= 2
            and inp.shape[-1] % MXFP8_BLOCK == 0
            and math.prod(inp.shape[:-1]) % MXFP8_BLOCK == 0
        )

    def make_empty(
        self,
        shape: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ) -> TEShapedMXFP8Tensor:
        """A tensor of this quantizer's usages with zeroed buffers (TE's are uninitialised)."""
        shape = torch.Size(shape)
        device = torch.device(device) if device is not None else torch.device("cpu")
        buffers: dict[str, Any] = {}
        for direction, used in (("rowwise", self.rowwise_usage), ("columnwise", self.columnwise_usage)):
            scale_shape = self.get_scale_shape(shape, direction == "columnwise")
            zeros = (lambda s: torch.zeros(s, dtype=torch.uint8, device=device)) if used else (lambda s: None)
            buffers[f"{direction}_data"] = zeros(shape)
            buffers[f"{direction}_scale_inv"] = zeros(scale_shape)
        return TEShapedMXFP8Tensor(
            shape=shape,
            dtype=dtype,
            fp8_dtype=self.dtype,
            quantizer=self,
            requires_grad=requires_grad,
            **buffers,
        )

    def update_quantized(
        self, src: torch.Tensor, dst: TEShapedMXFP8Tensor, *, noop_flag: torch.Tensor | None = None
    ) -> TEShapedMXFP8Tensor:
        """Quantize ``src`` into ``dst``'s buffers, in the directions this quantizer's usage asks."""
        if not isinstance(dst, TEShapedMXFP8Tensor):
            raise TypeError(f"cannot store MXFP8 in {type(dst).__name__}")
        if noop_flag is not None and bool(noop_flag.item() == 1.0):
            return dst
        # TE's kernels see (prod(shape[:-1]), shape[-1]); a view with leading axes (a checkpoint
        # loader's) shares its parent's 2-D scales.
        src = _plain_values(src).to(dst.device).reshape(-1, dst.shape[-1])
        for direction, used in (("rowwise", self.rowwise_usage), ("columnwise", self.columnwise_usage)):
            if not used:
                continue
            data = getattr(dst, f"_{direction}_data")
            if data is None:
                raise RuntimeError(f"{direction} usage requested, the destination has no {direction} data")
            cast = mxfp8_cast_columnwise if direction == "columnwise" else mxfp8_cast
            codes, scales = cast(src)
            scale_inv = getattr(dst, f"_{direction}_scale_inv")
            data.copy_(codes.view(torch.uint8).reshape(data.shape))
            scale_inv[: scales.shape[0], : scales.shape[1]].copy_(scales)
        dst._fp8_dtype = self.dtype
        return dst

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        out: TEShapedMXFP8Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> TEShapedMXFP8Tensor:
        """A new tensor (or ``out`` refilled); under autograd the cast passes gradients through
        unchanged, as TE's ``_QuantizeFunc`` does."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _Quantize.apply(tensor, self)  # type: ignore[no-any-return]
        return self._quantize_impl(tensor)

    __call__ = quantize

    def _quantize_impl(self, tensor: torch.Tensor) -> TEShapedMXFP8Tensor:
        nominal = tensor.dtype if tensor.dtype.is_floating_point else torch.float32
        with torch.no_grad():
            out = self.make_empty(tensor.shape, dtype=nominal, device=tensor.device)
            return self.update_quantized(tensor, out)


class _Quantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, quantizer: TEShapedMXFP8Quantizer) -> torch.Tensor:
        return quantizer._quantize_impl(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TEShapedMXFP8Tensor(TEShapedQuantizedTensor):
    """Stands in for TE's ``MXFP8Tensor`` (``fp8_utils.MXFP8Tensor``). See the module docstring."""

    _rowwise_data: torch.Tensor | None
    _rowwise_scale_inv: torch.Tensor | None
    _columnwise_data: torch.Tensor | None
    _columnwise_scale_inv: torch.Tensor | None
    _quantizer: TEShapedMXFP8Quantizer | None
    _fp8_dtype: DType
    _with_gemm_swizzled_scales: bool

    @staticmethod
    def __new__(  # type: ignore[override]
        cls,
        *,
        shape: Any,
        dtype: torch.dtype,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        columnwise_scale_inv: torch.Tensor | None,
        fp8_dtype: DType = DType.kFloat8E4M3,
        quantizer: TEShapedMXFP8Quantizer | None = None,
        requires_grad: bool = False,
        device: Any = None,
        with_gemm_swizzled_scales: bool = False,
        fake_dtype: torch.dtype | None = None,
    ) -> Any:
        some = rowwise_data if rowwise_data is not None else columnwise_data
        if some is None:
            raise ValueError("an MXFP8 tensor needs row-wise or column-wise data")
        self = TEShapedQuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=device or some.device
        )
        self._rowwise_data, self._rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self._columnwise_data, self._columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        # TE's constructor keeps a copy: the usage flags of a tensor's quantizer are its own.
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._fp8_dtype = fp8_dtype
        self._with_gemm_swizzled_scales = with_gemm_swizzled_scales
        return self

    def get_metadata(self) -> dict[str, Any]:
        """TE's constructor keywords, each from the attribute of the same name with a ``_``."""
        return {key: getattr(self, f"_{key}") for key in _METADATA}

    @classmethod
    def make_like(
        cls,
        tensor: TEShapedMXFP8Tensor,
        *,
        shape: Any = None,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
    ) -> TEShapedMXFP8Tensor:
        """A new tensor over the same buffers (TE's ``make_like``: what ``detach`` returns)."""
        return cls(
            shape=shape if shape is not None else tensor.shape,
            dtype=dtype or tensor.dtype,
            requires_grad=requires_grad,
            device=tensor.device,
            **tensor.get_metadata(),
        )

    def detach(self) -> TEShapedMXFP8Tensor:  # type: ignore[override]
        return type(self).make_like(self)

    def clone(self) -> TEShapedMXFP8Tensor:  # type: ignore[override]
        meta = self.get_metadata()
        for key in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            meta[key] = None if meta[key] is None else meta[key].clone()
        return type(self)(shape=self.shape, dtype=self.dtype, device=self.device, **meta)

    def get_usages(self) -> dict[str, bool]:
        return {"rowwise": self._rowwise_data is not None, "columnwise": self._columnwise_data is not None}

    def get_data_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._rowwise_data, self._columnwise_data

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None) -> None:
        """Drop a direction (TE cannot add one without re-quantizing from high precision)."""
        for direction, want in (("rowwise", rowwise_usage), ("columnwise", columnwise_usage)):
            have = getattr(self, f"_{direction}_data") is not None
            if want and not have:
                raise RuntimeError(f"requested {direction} usage, the MXFP8 tensor has no {direction} data")
            if want is False:
                setattr(self, f"_{direction}_data", None)
                setattr(self, f"_{direction}_scale_inv", None)

    def _dequantize(self, dtype: torch.dtype, columnwise: bool = False) -> torch.Tensor:
        if columnwise or self._rowwise_data is None:
            if self._columnwise_data is None:
                raise RuntimeError("requested column-wise values, the MXFP8 tensor has no column-wise data")
            assert self._columnwise_scale_inv is not None
            values = mxfp8_decode(self._columnwise_data, self._columnwise_scale_inv, columnwise=True)
        else:
            assert self._rowwise_scale_inv is not None
            values = mxfp8_decode(self._rowwise_data, self._rowwise_scale_inv)
        return values.to(dtype).reshape(self.shape)

    def _gemm_operand(self, contraction_dim: int) -> torch.Tensor:
        # Row-wise blocks run along the last dimension: the copy a GEMM contracting over dim 1
        # reads (forward x @ W.T); the grad-input GEMM dy @ W contracts over dim 0.
        return self._dequantize(self.dtype, columnwise=contraction_dim == 0)

    def quantize_(
        self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None
    ) -> TEShapedMXFP8Tensor:
        """Re-quantize in place, every direction this tensor holds, from ``tensor``'s values."""
        quantizer = (self._quantizer or TEShapedMXFP8Quantizer()).copy()
        quantizer.set_usage(**self.get_usages())
        quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _get_data(self) -> TEShapedMXFP8Tensor:
        return self.detach()

    def _set_data(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, TEShapedMXFP8Tensor) and tensor.shape == self.shape:
            for key, value in tensor.get_metadata().items():
                setattr(self, f"_{key}", value.copy() if key == "quantizer" and value is not None else value)
            return
        if tensor.shape != self.shape:
            raise RuntimeError(f"cannot set a {tuple(self.shape)} MXFP8 param to {tuple(tensor.shape)}")
        with torch.no_grad():
            self.quantize_(tensor)

    data = property(_get_data, _set_data)  # type: ignore[assignment]

    def _transposed(self, func: Any, rest: Any) -> Any:
        if self.dim() == 2 and (func is aten.t.default or _swaps_2d(func, rest)):
            return _TransposedView(self.detach())
        return None

    def _view(self, shape: Any) -> Any:
        shape = list(shape)
        if -1 in shape:
            shape[shape.index(-1)] = self.numel() // max(1, -math.prod(shape))
        if len(shape) < 2 or shape[-1] != self.shape[-1]:
            return None  # a view that splits the blocks: plain values, as TE's _ViewFunc gives
        views: dict[str, Any] = {
            k: (None if v is None else v.view(shape)) if k.endswith("_data") else v
            for k, v in self.get_metadata().items()
        }
        return type(self)(shape=shape, dtype=self.dtype, device=self.device, **views)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild, (self.get_metadata(), self.dtype, tuple(self.shape)))


def _rebuild(meta: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]) -> TEShapedMXFP8Tensor:
    return TEShapedMXFP8Tensor(shape=shape, dtype=dtype, **meta)


# ---------------------------------------------------------------------------- params and registration
def _get_high_precision_init_val(param: torch.Tensor) -> torch.Tensor | None:
    return getattr(param, "_high_precision_init_val", None)


def _clear_high_precision_init_val(param: torch.Tensor) -> None:
    if hasattr(param, "_high_precision_init_val"):
        del param._high_precision_init_val


def make_te_mxfp8_param(init_values: torch.Tensor) -> torch.nn.Parameter:
    """A trainable TE-shaped MXFP8 param from ``init_values``, as TE's fp8 model init makes one:
    both usages (grad mode is on during training init), the bf16 init values kept on CPU for the
    distributed optimizer's main params."""
    init = init_values.detach().to(torch.bfloat16)
    quantizer = TEShapedMXFP8Quantizer(rowwise=True, columnwise=True)
    with torch.no_grad():
        tensor = quantizer.quantize(init)
    param = torch.nn.Parameter(tensor, requires_grad=True)
    param._high_precision_init_val = init.cpu().clone()  # type: ignore[attr-defined]
    param.get_high_precision_init_val = types.MethodType(_get_high_precision_init_val, param)  # type: ignore[attr-defined]
    param.clear_high_precision_init_val = types.MethodType(_clear_high_precision_init_val, param)  # type: ignore[attr-defined]
    return param


#: TE's MXFP8 tensor keywords (``get_metadata``), stored as ``_<name>`` attributes.
_METADATA = (
    "rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
    "fp8_dtype", "quantizer", "with_gemm_swizzled_scales",
)  # fmt: skip


@contextlib.contextmanager
def te_shaped_mxfp8() -> Iterator[None]:
    """Register the TE-shaped classes in ``megatron.core.fp8_utils`` (reversible): its
    ``is_float8tensor`` / ``is_mxfp8tensor`` read these globals at call time."""
    with registered_in_fp8_utils(TEShapedQuantizedTensor, TEShapedMXFP8Tensor):
        yield
