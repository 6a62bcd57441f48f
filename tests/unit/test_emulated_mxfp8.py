"""The kit's emulated MXFP8 parameter (testing/emulated_mxfp8.py) behaves the way megatron-core relies
on: a trainable bf16 leaf whose writes quantize, a plain grad, and a registration megatron-core
recognises and that is reversible. The cast it quantizes with: tests/unit/test_mxfp8_cast.py."""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.testing import emulated_mxfp8, make_mxfp8_param
from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_quantize


def test_param_writes_quantize_and_keep_high_precision_init():
    init = torch.randn(5, 64)
    p = make_mxfp8_param(init)
    assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.dtype == torch.bfloat16
    assert torch.equal(p.get_high_precision_init_val(), init.to(torch.bfloat16))
    new = torch.randn(5, 64, dtype=torch.bfloat16)
    p.data.copy_(new)
    assert torch.equal(p.detach().float(), mxfp8_quantize(new))
    p.clear_high_precision_init_val()
    assert "_high_precision_init_val" not in p.__dict__


def test_autograd_sees_a_leaf_with_a_plain_grad():
    p = make_mxfp8_param(torch.randn(4, 32))
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, p).float().sum().backward()
    assert type(p.grad) is torch.Tensor and p.grad.shape == p.shape
    acc = p.expand_as(p).grad_fn.next_functions[0][0]
    assert type(acc).__name__ == "AccumulateGrad"


def test_registration_is_recognised_by_megatron_core_and_reversible():
    fp8_utils = pytest.importorskip("megatron.core.fp8_utils")
    p = make_mxfp8_param(torch.randn(2, 32))
    assert not fp8_utils.is_mxfp8tensor(p)
    with emulated_mxfp8():
        assert fp8_utils.is_float8tensor(p) and fp8_utils.is_mxfp8tensor(p)
        assert not fp8_utils.is_float8tensor(torch.zeros(1))
    assert not fp8_utils.is_float8tensor(p)
