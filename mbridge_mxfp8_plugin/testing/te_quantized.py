"""The wrapper half of the kit's TE-shaped MXFP8 type: a tensor whose ops run on dequantized values.

Transformer Engine's ``QuantizedTensor`` is a ``torch.Tensor`` wrapper subclass with no storage of
its own and ``__torch_function__`` disabled; its ``__torch_dispatch__`` runs most ops on the
dequantized values and quantizes on ``copy_`` and in-place ops. :class:`TEShapedQuantizedTensor`
has that behaviour (facts from TE 2.x, code of its own), plus one rule TE implements in its
modules rather than in the tensor: a GEMM (``aten.mm`` / ``aten.addmm``) reads each quantized
operand through :meth:`TEShapedQuantizedTensor._gemm_operand` with the dimension it contracts
over, and a 2-D transpose returns a :class:`_TransposedView` that keeps that choice for the GEMM
consuming it. The MXFP8 specifics are in :mod:`.te_mxfp8`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: TEShapedQuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor._dequantize(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _plain_values(t: torch.Tensor) -> torch.Tensor:
    return t._dequantize(t.dtype) if isinstance(t, TEShapedQuantizedTensor) else t.detach()


class TEShapedQuantizedTensor(torch.Tensor):
    """Stands in for TE's ``QuantizedTensor`` (``fp8_utils.FP8_TENSOR_CLASS``): a wrapper whose
    ops run on dequantized values, except the ones :meth:`__torch_dispatch__` names."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, shape: Any, dtype: torch.dtype, *, requires_grad: bool = False, device: Any = None
    ) -> Any:
        shape = torch.Size(shape)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous_strides(shape),
            dtype=dtype,
            layout=torch.strided,
            requires_grad=requires_grad,
            device=device,
        )

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _gemm_operand(self, contraction_dim: int) -> torch.Tensor:
        """The values a GEMM reads when it contracts over ``contraction_dim`` of this operand."""
        return self._dequantize(self.dtype)

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)  # type: ignore[no-any-return]
        return self._dequantize(dtype)

    def float(self) -> torch.Tensor:  # type: ignore[override]
        return self.dequantize(dtype=torch.float32)

    def bfloat16(self) -> torch.Tensor:  # type: ignore[override]
        return self.dequantize(dtype=torch.bfloat16)

    def half(self) -> torch.Tensor:  # type: ignore[override]
        return self.dequantize(dtype=torch.float16)

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:  # type: ignore[override]
        return self.dequantize().cpu(memory_format=memory_format)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """TE's tensors live on the GPU, where a copy to the host dequantizes (a checkpoint writer's
        copy: checkpoints hold bf16). The kit's live on the host, where torch would hand back the
        tensor itself: a host target dequantizes here too."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and torch.device(device).type == "cpu":
            return self.dequantize().to(*args, **kwargs)
        return super().to(*args, **kwargs)

    def untyped_storage(self) -> torch.UntypedStorage:
        # No storage of its own (the bytes are in the buffers); as TE's, so writers copy it.
        return torch.UntypedStorage(0, device=self.device)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}(data={self._dequantize(self.dtype)})"

    def quantize_(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return args[0].detach()
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, TEShapedQuantizedTensor):
                dst.quantize_(src)
            else:
                dst.copy_(_plain_values(src))
            return dst
        if func in (aten.t.default, aten.transpose.int, aten.permute.default):
            transposed = args[0]._transposed(func, args[1:])
            if transposed is not None:
                return transposed
        if func in (aten.mm.default, aten.addmm.default):
            a, b = args[-2], args[-1]
            a = a._gemm_operand(1) if isinstance(a, TEShapedQuantizedTensor) else a
            b = b._gemm_operand(0) if isinstance(b, TEShapedQuantizedTensor) else b
            return func(*(tree_map(_unwrap, args[:-2])), a, b, **tree_map(_unwrap, kwargs))
        if func is aten.view.default:
            view = args[0]._view(args[1])
            if view is not None:
                return view
        if func._schema.is_mutable:
            return _mutate(func, args, kwargs)
        return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

    def _transposed(self, func: Any, rest: Any) -> Any:
        return None

    def _view(self, shape: Any) -> Any:
        return None


def _unwrap(x: Any) -> Any:
    return x._dequantize(x.dtype) if isinstance(x, TEShapedQuantizedTensor) else x


def _mutate(func: Any, args: Any, kwargs: Any) -> Any:
    """In-place op on a quantized tensor: dequantize, run, quantize the written arguments back."""
    plain = tree_map(_unwrap, args)
    func(*plain, **tree_map(_unwrap, kwargs))
    for arg, new, schema in zip(args, plain, func._schema.arguments, strict=False):
        alias = getattr(schema, "alias_info", None)
        if isinstance(arg, TEShapedQuantizedTensor) and alias is not None and alias.is_write:
            arg.quantize_(new)
    return args[0]


def _swaps_2d(func: Any, rest: Any) -> bool:
    if func is aten.transpose.int:
        return sorted(d % 2 for d in rest[:2]) == [0, 1]
    return func is aten.permute.default and [d % 2 for d in rest[0]] == [1, 0]


class _TransposedView(TEShapedQuantizedTensor):
    """``W.t()`` of a 2-D quantized tensor: remembers ``W`` so the GEMM that consumes it reads the copy
    whose blocks run along its contraction dimension, and ``.t()`` gives ``W`` back."""

    _source: Any

    @staticmethod
    def __new__(cls, source: Any) -> Any:  # type: ignore[override]
        self = TEShapedQuantizedTensor.__new__(
            cls, (source.shape[1], source.shape[0]), source.dtype, device=source.device
        )
        self._source = source
        return self

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._source._dequantize(dtype).t()

    def _gemm_operand(self, contraction_dim: int) -> torch.Tensor:
        return self._source._gemm_operand(1 - contraction_dim).t()

    def _transposed(self, func: Any, rest: Any) -> Any:
        if func is aten.t.default or _swaps_2d(func, rest):
            return self._source.detach()
        return None

    def quantize_(self, tensor: torch.Tensor) -> None:
        self._source.quantize_(tensor.t())
