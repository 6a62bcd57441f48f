"""The shard check's fast path compares codes and scale bytes; where bytes differ it must still
judge by value. A block re-encoded with another scale (what a checkpoint load does to about 5%
of blocks) passes; a block whose value changed fails and is named. Single process, the kit's
TE-shaped type, the verifier's ``ShardCheck`` driven directly with a main shard."""

from __future__ import annotations

import torch

from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
from mbridge_mxfp8_plugin.verify.batches import Owned
from mbridge_mxfp8_plugin.verify.read import reader_for
from mbridge_mxfp8_plugin.verify.report import WeightReport
from mbridge_mxfp8_plugin.verify.shard import ShardCheck


def _param() -> tuple[torch.Tensor, torch.Tensor]:
    """A TE-shaped (64, 128) param and its fp32 main: block 0 of row 0 all ones (TE's rule gives
    codes 256 at scale 2**-8), the rest random."""
    torch.manual_seed(0)
    values = (torch.randn(64, 128) * 0.02).to(torch.bfloat16)
    values[0, :32] = 1.0
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
    return param, values.float().reshape(-1)


def _check(param: torch.Tensor, main: torch.Tensor, budget: int = 64 << 20) -> WeightReport:
    report = WeightReport(event="test")
    check = ShardCheck(report, atol=0.0, stride=1, offset=0, budget_bytes=budget)
    reader = reader_for(param)
    assert not isinstance(reader, str)
    check.add("w", param, reader, Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    return report


def _code(value: float) -> int:
    return int(torch.tensor([value]).to(torch.float8_e4m3fn).view(torch.uint8))


def test_equal_bytes_pass() -> None:
    param, main = _param()
    report = _check(param, main)
    assert report.ok and report.params_checked == 1 and not report.unchecked
    assert report.elements_checked == main.numel()


def test_reencoded_block_passes_by_value() -> None:
    param, main = _param()
    codes, scales = param._rowwise_data, param._rowwise_scale_inv
    assert int(codes[0, 0]) == _code(256.0)
    # The same values with half the codes and twice the scale: other bytes, equal values.
    codes[0, :32] = _code(128.0)
    scales[0, 0] += 1
    assert torch.equal(param.dequantize()[0, :32], torch.ones(32, dtype=torch.bfloat16))
    for budget in (64 << 20, 1):  # one batch; the smallest batches (32 blocks each)
        report = _check(param, main, budget)
        assert report.ok, report.message()


def test_changed_value_in_a_byte_differing_batch_is_named() -> None:
    param, main = _param()
    param._rowwise_data[0, :32] = _code(128.0)
    param._rowwise_scale_inv[0, 0] += 1  # equal values, other bytes ...
    param._rowwise_data[5, 40] ^= 0x01  # ... and one element whose value changed
    report = _check(param, main)
    assert not report.ok
    assert report.shard_mismatch_count == 1
    assert report.shard_mismatches[0].name == "w" and report.shard_mismatches[0].elements == 1


def test_changed_scale_is_caught() -> None:
    param, main = _param()
    param._rowwise_scale_inv[3, 1] += 1  # every element of that block doubles
    report = _check(param, main)
    assert not report.ok and report.shard_mismatches[0].elements > 0
