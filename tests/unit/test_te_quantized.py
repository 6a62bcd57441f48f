"""The wrapper half of the kit's TE-shaped type (testing/te_quantized.py), on a quantized type of
its own: ``Halves`` rounds every value to a multiple of 0.5 when written and, to tell the GEMM
operands apart, hands a GEMM that contracts over dim 0 ten times its values.

What TE 2.x's ``QuantizedTensor`` does, and megatron-core and the checkpoint writers rely on: ops
run on the dequantized values and return plain tensors; ``copy_`` into the tensor and in-place ops
quantize; a host copy is plain values; the tensor has no storage of its own; ``dequantize`` passes
gradients straight through; a GEMM reads each operand through ``_gemm_operand`` with the dimension
it contracts over, and ``W.t()`` keeps that choice for the GEMM that consumes it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.testing.te_quantized import TEShapedQuantizedTensor, _TransposedView


class Halves(TEShapedQuantizedTensor):
    _values: torch.Tensor

    @staticmethod
    def __new__(cls, values: torch.Tensor, *, requires_grad: bool = False) -> Any:  # type: ignore[override]
        self = TEShapedQuantizedTensor.__new__(cls, values.shape, torch.float32, requires_grad=requires_grad)
        self._values = values  # shared, as a TE tensor's detach shares its buffers
        return self

    @classmethod
    def of(cls, values: torch.Tensor, **kw: Any) -> Halves:
        t = cls(torch.zeros(values.shape), **kw)
        t.quantize_(values)
        return t

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._values.to(dtype).clone()

    def quantize_(self, tensor: torch.Tensor) -> Halves:
        plain = tensor._dequantize(torch.float32) if isinstance(tensor, TEShapedQuantizedTensor) else tensor
        self._values.copy_(torch.round(plain.detach().float() * 2) / 2)
        return self

    def detach(self) -> Halves:  # type: ignore[override]
        return Halves(self._values)

    def _gemm_operand(self, contraction_dim: int) -> torch.Tensor:
        return self._values * (10.0 if contraction_dim == 0 else 1.0)

    def _transposed(self, func: Any, rest: Any) -> Any:
        return _TransposedView(self.detach()) if self.dim() == 2 else None


def _w() -> Halves:
    return Halves.of(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))


def test_ops_run_on_the_dequantized_values_and_return_plain_tensors() -> None:
    w = _w()
    out = w + 1
    assert type(out) is torch.Tensor and torch.equal(out, w._values + 1)
    assert type(w.sum()) is torch.Tensor and w.sum().item() == 21.0


def test_copy_into_the_tensor_quantizes_and_out_of_it_gives_values() -> None:
    w = _w()
    w.copy_(torch.full((2, 3), 0.3))  # megatron-core's write-back after the all-gather
    assert torch.equal(w._values, torch.full((2, 3), 0.5))
    plain = torch.zeros(2, 3)
    plain.copy_(w)
    assert torch.equal(plain, torch.full((2, 3), 0.5))


def test_in_place_ops_quantize_what_they_wrote() -> None:
    w = Halves.of(torch.ones(2, 3))
    w.mul_(1.2)  # 1.2 -> rounded to 1.0
    assert torch.equal(w._values, torch.ones(2, 3))
    w.add_(0.8)  # 1.8 -> 2.0
    assert torch.equal(w._values, torch.full((2, 3), 2.0))


def test_host_copies_are_plain_values_and_there_is_no_storage() -> None:
    """What a checkpoint writer copies: plain values (TE's bf16), never the wrapper."""
    w = _w()
    for copy in (w.cpu(), w.to("cpu"), w.float(), w.to(torch.device("cpu"), torch.float32)):
        assert type(copy) is torch.Tensor and torch.equal(copy, w._values), copy
    assert w.bfloat16().dtype == torch.bfloat16 and type(w.bfloat16()) is torch.Tensor
    assert w.untyped_storage().nbytes() == 0
    assert "Halves" in repr(w)


def test_dequantize_passes_gradients_straight_through() -> None:
    w = Halves.of(torch.ones(2, 3), requires_grad=True)
    (w.dequantize() * torch.arange(6.0).view(2, 3)).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.arange(6.0).view(2, 3))
    assert type(w.grad) is torch.Tensor
    with torch.no_grad():
        assert w.dequantize().grad_fn is None


def test_gemms_read_each_operand_along_the_dimension_they_contract() -> None:
    """Forward ``x @ W.T`` contracts W over its dim 1; the grad-input GEMM ``dy @ W`` over dim 0."""
    w = _w()
    x, dy = torch.ones(1, 3), torch.ones(1, 2)
    assert torch.equal(torch.mm(x, w.t()), x @ w._values.t())  # W.t() consumed: W's dim 1
    assert torch.equal(torch.mm(dy, w), dy @ (10 * w._values))  # W consumed over its dim 0
    bias = torch.zeros(2)
    assert torch.equal(torch.addmm(bias, x, w.t()), x @ w._values.t())
    assert torch.equal(torch.nn.functional.linear(x, w), x @ w._values.t())
    # As the first operand a GEMM contracts over dim 1 of what it is handed.
    assert torch.equal(torch.mm(w, torch.ones(3, 1)), w._values @ torch.ones(3, 1))
    assert torch.equal(torch.mm(w.t(), torch.ones(2, 1)), (10 * w._values).t() @ torch.ones(2, 1))


def test_a_transpose_remembers_its_source() -> None:
    w = _w()
    t = w.t()
    assert isinstance(t, _TransposedView) and t.shape == (3, 2)
    assert torch.equal(t.dequantize(), w._values.t())
    back = t.t()
    assert type(back) is Halves and back._values is w._values  # W again, not a copy
    assert type(w.transpose(0, 1)) is _TransposedView and type(w.transpose(-1, -2)) is _TransposedView
    t.copy_(torch.full((3, 2), 0.3))  # writing through the view quantizes the source, transposed
    assert torch.equal(w._values, torch.full((2, 3), 0.5))


def test_the_wrapper_refuses_what_a_subclass_must_define() -> None:
    bare = TEShapedQuantizedTensor((2, 3), torch.float32)
    with pytest.raises(NotImplementedError):
        bare.dequantize()
    with pytest.raises(NotImplementedError):
        bare.quantize_(torch.zeros(2, 3))
