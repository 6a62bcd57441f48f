"""The emulated MXFP8 tensor must behave the way megatron-core relies on (see its module docstring)."""

from __future__ import annotations

import math

import pytest
import torch

from mbridge_mxfp8_plugin.testing import emulated_mxfp8, make_mxfp8_param, mxfp8_quantize


def _e4m3_grid() -> torch.Tensor:
    """All finite non-negative E4M3 values, enumerated from the format definition (bias 7)."""
    values = {0.0}
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN encoding
            values.add((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(sorted(values))


def test_quantized_values_lie_on_scaled_e4m3_grid():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen) * torch.logspace(-3, 3, 64)
    q = mxfp8_quantize(x)
    grid = _e4m3_grid()
    for block_x, block_q in zip(x.reshape(-1, 32), q.reshape(-1, 32), strict=True):
        scale = 2.0 ** (math.floor(math.log2(block_x.abs().max().item())) - 8)
        scaled = (block_q / scale).abs()
        assert torch.isin(scaled, grid).all()
        # round-to-nearest: no grid point is closer to the input than the chosen one
        err = (block_q - block_x).abs()
        nearest = (grid[None, :] * scale - block_x.abs()[:, None]).abs().min(dim=1).values
        unclamped = block_x.abs() <= 448 * scale
        assert torch.all(err[unclamped] <= nearest[unclamped] + 1e-12)


def test_quantize_is_idempotent_and_exact_in_bf16():
    x = torch.randn(3, 96)
    q = mxfp8_quantize(x)
    assert torch.equal(mxfp8_quantize(q), q)
    assert torch.equal(q.to(torch.bfloat16).float(), q)


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
