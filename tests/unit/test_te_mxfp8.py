"""The kit's TE-shaped MXFP8 param (``testing/te_mxfp8.py``) holds what Transformer Engine's holds,
in both directions, and behaves where megatron-core touches it as TE's ``MXFP8Tensor`` does.

Bytes and values of the crafted block are worked out by hand from TE's rule (as
mbridge_mxfp8_plugin/mxfp8_cast.py states it; the arithmetic is in the comments); the Gaussian
cases check properties emulated_mxfp8's docstring states (re-quantizing dequantized values keeps
the values, halves the scale of the blocks whose max is at most 224 * s), with the criterion
computed from the stored scale bytes, not by the cast.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.testing import (
    TEShapedMXFP8Quantizer,
    TEShapedMXFP8Tensor,
    emulated_mxfp8,
    make_mxfp8_param,
    make_te_mxfp8_param,
    mxfp8_reference_weight,
    param_kind,
    te_shaped_mxfp8,
)

TINY = 3 * 2.0**-17  # exact in bf16 (1.1b * 2**-16)


def _crafted() -> torch.Tensor:
    """A 32x32 weight: w[0, 0] = 3.0, w[0, 1] = TINY, zeros elsewhere.

    Row-wise block (row 0): amax 3.0; 3 * fp32(1/448) = 0.006696... lies in (2**-8, 2**-7], so the
    scale rounds up to 2**-7: E8M0 byte 127 - 7 = 120. 3.0 * 2**7 = 384 = 1.5 * 2**8 -> E4M3
    exponent field 8 + 7 = 15, mantissa 0b100 -> 0x7C. TINY * 2**7 = 1.5 * 2**-9: below E4M3's
    smallest normal 2**-6, 1.5 subnormal steps of 2**-9 -> ties to even, 2 steps -> code 0x02,
    value 2 * 2**-9 * 2**-7 = 2**-15 (not TINY). All-zero row blocks: byte 0, codes 0.
    Column-wise blocks (32 rows of one column): column 0 holds only 3.0 -> byte 120, code 0x7C;
    column 1 holds only TINY: TINY * fp32(1/448) lies in (2**-25, 2**-24] -> scale 2**-24, byte
    103, TINY * 2**24 = 384 -> code 0x7C, value TINY exactly.
    """
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    w[0, 0], w[0, 1] = 3.0, TINY
    return w


def test_rowwise_bytes_and_values_of_a_crafted_block():
    p = make_te_mxfp8_param(_crafted())
    assert p._rowwise_data.dtype == torch.uint8 and p._rowwise_data.shape == (32, 32)
    assert p._rowwise_data[0, :3].tolist() == [0x7C, 0x02, 0x00]
    assert int(p._rowwise_data[1:].count_nonzero()) == 0
    # One byte per 1x32 block, padded like TE to (128, 4) tiles: (32, 1) -> (128, 4).
    assert p._rowwise_scale_inv.shape == (128, 4)
    assert p._rowwise_scale_inv[0, 0].item() == 120
    assert int(p._rowwise_scale_inv[1:32, 0].count_nonzero()) == 0
    values = p.dequantize()
    assert values.dtype == torch.bfloat16 and values.shape == (32, 32)
    assert values[0, 0].item() == 3.0 and values[0, 1].item() == 2.0**-15


def test_columnwise_bytes_and_values_of_a_crafted_block():
    p = make_te_mxfp8_param(_crafted())
    assert p._columnwise_data.dtype == torch.uint8 and p._columnwise_data.shape == (32, 32)
    assert p._columnwise_data[0, :3].tolist() == [0x7C, 0x7C, 0x00]
    # One byte per 32x1 block down the first dim, padded to (4, 128) tiles: (1, 32) -> (4, 128).
    assert p._columnwise_scale_inv.shape == (4, 128)
    assert p._columnwise_scale_inv[0, :3].tolist() == [120, 103, 0]
    columnwise = p._dequantize(torch.float32, columnwise=True)
    assert columnwise[0, 0].item() == 3.0 and columnwise[0, 1].item() == TINY


def test_param_reports_bf16_and_is_a_trainable_leaf():
    p = make_te_mxfp8_param(torch.randn(64, 96))
    assert isinstance(p, torch.nn.Parameter) and isinstance(p, TEShapedMXFP8Tensor)
    assert p.dtype == torch.bfloat16 and p.shape == (64, 96) and p.numel() == 64 * 96
    assert p.requires_grad and p.is_leaf
    assert p._fp8_dtype.name == "kFloat8E4M3"
    assert p._quantizer.rowwise_usage and p._quantizer.columnwise_usage


def test_gemms_read_the_copy_blocked_along_their_contraction_dim():
    """Forward x @ W.T reads the row-wise copy, the grad-input GEMM dy @ W the column-wise one,
    through torch's linear and through megatron-core's linear autograd function."""
    import inspect

    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Fn

    # Its positional arguments vary by release; no fusion, no collectives, one GTP shard.
    given = {"bias": None, "wgrad_deferral_limit": 0, "gtp_remat_size": 1}
    names = list(inspect.signature(Fn.forward).parameters)[3:]  # after ctx, input, weight
    flags = ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel")
    rest = [given[n] if n in given else (False if n in flags else None) for n in names]
    for linear in (
        lambda x, w: torch.nn.functional.linear(x, w),
        lambda x, w: Fn.apply(x, w, *rest),
    ):
        p = make_te_mxfp8_param(_crafted())
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        x[0, 1] = 1.0
        x.requires_grad_(True)
        y = linear(x, p)
        assert y[0, 0].item() == 2.0**-15  # the row-wise value of w[0, 1]
        y[0, 0].backward()
        assert x.grad is not None and x.grad[0, 1].item() == TINY  # its column-wise value
        assert p.grad is not None and type(p.grad) is torch.Tensor
        assert torch.equal(p.grad[0], x.detach()[0])


def test_copy_quantizes_through_the_quantizer():
    p = make_te_mxfp8_param(torch.randn(32, 32))
    data = p.data  # what megatron-core's write-back after the all-gather writes into
    assert isinstance(data, TEShapedMXFP8Tensor) and data._rowwise_data is p._rowwise_data
    data.copy_(_crafted())
    assert p._rowwise_data[0, :2].tolist() == [0x7C, 0x02] and p._rowwise_scale_inv[0, 0].item() == 120
    assert p._columnwise_scale_inv[0, :2].tolist() == [120, 103]
    with torch.no_grad():
        p.copy_(torch.zeros(32, 32, dtype=torch.bfloat16))
    assert int(p._rowwise_data.count_nonzero()) == 0 and int(p._columnwise_scale_inv.count_nonzero()) == 0


def test_quantizer_api():
    q = TEShapedMXFP8Quantizer(rowwise=True, columnwise=True)
    c = q.copy()
    c.set_usage(rowwise=True, columnwise=False)
    assert q.columnwise_usage and not c.columnwise_usage and c.rowwise_usage
    out = c.quantize(_crafted())
    assert isinstance(out, TEShapedMXFP8Tensor) and out._columnwise_data is None
    assert out.dequantize(dtype=torch.float32)[0, 1].item() == 2.0**-15
    empty = q.make_empty((64, 32), dtype=torch.bfloat16)
    assert empty.dtype == torch.bfloat16 and empty._rowwise_scale_inv.shape == (128, 4)
    assert q.update_quantized(_crafted().repeat(2, 1), empty) is empty
    assert empty._rowwise_scale_inv[32, 0].item() == 120
    with pytest.raises(RuntimeError, match="column"):
        q.update_quantized(_crafted(), out)  # q asks for the column-wise copy, out has none


def test_requantizing_dequantized_values_keeps_values_changes_some_blocks():
    """A checkpoint load: bf16 values written back through copy_. Values are unchanged; a block
    whose dequantized max is <= 224 * s comes back with scale s / 2 (about 5% on Gaussian data)."""
    torch.manual_seed(0)
    p = make_te_mxfp8_param(torch.randn(256, 256))
    values = p.dequantize()
    scales = p._rowwise_scale_inv[:256, :8].clone()
    with torch.no_grad():
        p.copy_(values)
    assert torch.equal(p.dequantize(), values)
    new_scales = p._rowwise_scale_inv[:256, :8]
    changed = new_scales != scales
    block_max = values.float().abs().reshape(256, 8, 32).amax(dim=-1)
    expected = block_max <= 224.0 * torch.exp2(scales.float() - 127)
    assert torch.equal(changed, expected)
    assert torch.equal(new_scales[changed].int(), scales[changed].int() - 1)
    assert 0.02 < changed.float().mean().item() < 0.10


def test_load_rederives_the_columnwise_copy_from_rowwise_values():
    """Defect F's mechanism: after a load the column-wise copy comes from dequantized row-wise
    values, so an element that is subnormal in its row block loses its column-wise value."""
    p = make_te_mxfp8_param(_crafted())
    with torch.no_grad():
        p.copy_(p.dequantize())
    assert p._dequantize(torch.float32, columnwise=True)[0, 1].item() == 2.0**-15  # was TINY


def test_state_dict_writes_bf16_and_loads_by_requantization(tmp_path):
    import torch.distributed.checkpoint as dcp

    layer = torch.nn.Linear(32, 32, bias=False)
    layer.weight = make_te_mxfp8_param(_crafted())
    dcp.save(layer.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    plain = {"weight": torch.zeros(32, 32, dtype=torch.bfloat16)}
    dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(plain["weight"], layer.weight.dequantize())
    assert layer.weight.cpu().dtype == torch.bfloat16 and type(layer.weight.cpu()) is torch.Tensor
    other = torch.nn.Linear(32, 32, bias=False)
    other.weight = make_te_mxfp8_param(torch.randn(32, 32))
    other.load_state_dict(plain)
    assert isinstance(other.weight, TEShapedMXFP8Tensor)
    assert other.weight._rowwise_data[0, :2].tolist() == [0x7C, 0x02]


def test_high_precision_init_val_as_te_sets_it():
    init = torch.randn(32, 64)
    p = make_te_mxfp8_param(init)
    assert torch.equal(p.get_high_precision_init_val(), init.to(torch.bfloat16))
    p.clear_high_precision_init_val()
    assert p.get_high_precision_init_val() is None  # TE keeps the accessors, drops the value


def test_megatron_core_recognises_it_and_registration_is_reversible(monkeypatch):
    from megatron.core import fp8_utils

    p = make_te_mxfp8_param(torch.randn(32, 32))
    assert not fp8_utils.is_mxfp8tensor(p)
    with te_shaped_mxfp8():
        assert fp8_utils.is_float8tensor(p) and fp8_utils.is_mxfp8tensor(p)
        assert not fp8_utils.is_mxfp8tensor(torch.nn.Parameter(torch.zeros(2, 32)))
    assert not fp8_utils.is_float8tensor(p)
    monkeypatch.setenv("MXFP8_PARAM_KIND", "te")
    with emulated_mxfp8():
        assert fp8_utils.is_mxfp8tensor(p)


def test_param_kind_selects_the_emulation(monkeypatch):
    monkeypatch.delenv("MXFP8_PARAM_KIND", raising=False)
    assert param_kind() == "values" and not isinstance(make_mxfp8_param(_crafted()), TEShapedMXFP8Tensor)
    monkeypatch.setenv("MXFP8_PARAM_KIND", "te")
    assert isinstance(make_mxfp8_param(_crafted()), TEShapedMXFP8Tensor)
    w = _crafted().requires_grad_(True)
    ref = mxfp8_reference_weight(w)
    x = torch.ones(1, 32, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, ref)[0, 0].backward()
    assert x.grad is not None and x.grad[0, 1].item() == TINY and w.grad is not None
    monkeypatch.setenv("MXFP8_PARAM_KIND", "bytes")
    with pytest.raises(ValueError, match="MXFP8_PARAM_KIND='bytes'.*'values'.*'te'"):
        param_kind()


def test_a_view_with_leading_axes_loads_into_the_param():
    """megatron-core 0.19's loader writes a checkpoint into ``param.data.view(1, *shape)`` (layer
    axis prepended) through ``copy_``: the view shares the param's codes and 2-D scales."""
    p = make_te_mxfp8_param(torch.randn(32, 32))
    view = p.data.view(1, 32, 32)
    assert isinstance(view, TEShapedMXFP8Tensor) and view.shape == (1, 32, 32)
    view.copy_(_crafted().unsqueeze(0))
    assert p._rowwise_data[0, :2].tolist() == [0x7C, 0x02] and p._rowwise_scale_inv[0, 0].item() == 120
    assert p._columnwise_scale_inv[0, :2].tolist() == [120, 103]
    assert torch.equal(view.dequantize()[0], p.dequantize())
