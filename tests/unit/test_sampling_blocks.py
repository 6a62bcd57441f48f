"""Which blocks a sampled check compares (verify/sampling.py), as integer arithmetic, in one process.

``verify_weights``'s docstring promises every ``round(1/sample)``-th block of each owned slice, *at
least one per param* on every call, the phase rotating with ``offset`` so every block is visited
within ``stride`` calls. An owned slice with fewer whole blocks than the stride is the case that
promise is about (issue 32.5): at no offset may it get nothing. Checked on the block arithmetic
for MXFP8 params (global block ids, whole blocks inside the shard) and bf16 params (runs of 32
from the shard start), and through the shard check's report. The rank-level rotation:
tests/ranks/test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.errors import MXFP8UsageError
from mbridge_mxfp8_plugin.verify.batches import Owned
from mbridge_mxfp8_plugin.verify.read import BLOCK, Blocks, Reader
from mbridge_mxfp8_plugin.verify.report import WeightReport
from mbridge_mxfp8_plugin.verify.sampling import first_sampled, mxfp8_blocks, runs, stride_of
from mbridge_mxfp8_plugin.verify.shard import ShardCheck

STRIDES = (2, 3, 16, 64)


def _ids(blocks: Blocks) -> list[int]:
    return [blocks.start + i * blocks.step for i in range(blocks.count)]


def test_stride_of_the_sample() -> None:
    assert stride_of(1.0) == 1 and stride_of(1 / 16) == 16 and stride_of(0.3) == 3
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(MXFP8UsageError):
            stride_of(bad)


@pytest.mark.parametrize("stride", STRIDES)
def test_first_sampled_is_always_a_block_of_the_slice(stride: int) -> None:
    for blocks in range(1, 2 * stride + 2):
        firsts = [first_sampled(offset, stride, blocks) for offset in range(2 * stride)]
        assert all(0 <= f < blocks for f in firsts), (blocks, firsts)
        assert firsts[:stride] == firsts[stride:]  # it depends on offset % stride only
        assert set(firsts) == set(range(min(stride, blocks)))


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("last", [64, 96, 45])
def test_a_slice_shorter_than_the_stride_gets_a_block_at_every_offset(stride: int, last: int) -> None:
    """MXFP8 params: a shard of ``n < stride`` whole blocks (starting and ending mid-row, so a
    straddling block on each side is skipped) yields one sampled block at each of the
    ``stride`` offsets, and the offsets together visit every one of the ``n`` blocks."""
    param = torch.empty(40, last)
    per_row = -(-last // BLOCK)
    for n in range(1, stride):
        g0 = 2 * per_row + 1  # block 0 of row 2 straddles the shard start: skipped
        s = 2 * last + 5
        g1 = g0 + n  # the shard ends 3 elements into block g1: skipped too
        r, j = divmod(g1, per_row)
        e = r * last + j * BLOCK + 3
        seen: set[int] = set()
        for offset in range(stride):
            blocks, _ = mxfp8_blocks(param, s, e, offset, stride)
            assert blocks.count >= 1, (n, offset)
            ids = _ids(blocks)
            assert all(g0 <= i < g1 for i in ids), (ids, g0, g1)
            seen.update(ids)
        assert seen == set(range(g0, g1)), (seen, g0, g1)


@pytest.mark.parametrize("stride", STRIDES)
def test_a_bf16_slice_shorter_than_the_stride_gets_a_run_at_every_offset(stride: int) -> None:
    for n in range(1, stride):
        s, e = 1000, 1000 + n * BLOCK + 7  # n whole runs and a short one
        seen: set[int] = set()
        for offset in range(stride):
            blocks, tail = runs(s, e, offset, stride)
            assert blocks.count >= 1 and blocks.origin == s, (n, offset)
            seen.update(_ids(blocks))
            assert tail == (7 if stride == 1 else 0)  # the short run only where every run is
        assert seen == set(range(n))


def test_a_slice_of_no_whole_block_has_nothing_to_sample() -> None:
    param = torch.empty(4, 64)
    blocks, whole = mxfp8_blocks(param, 70, 100, 3, 16)  # inside one block of row 1
    assert blocks.count == 0 and whole == 0
    blocks, tail = runs(0, 20, 3, 16)  # a bf16 shard shorter than a run: its tail alone
    assert blocks.count == 0 and tail == 20


@pytest.mark.parametrize("offset", range(16))
def test_every_short_param_is_compared_on_every_call(offset: int) -> None:
    """Through the shard check at the default sample: three bf16 params whose owned slices hold
    1, 3 and 15 runs of 32 are each compared on every call (elements > 0), and a changed run of
    the 3-run param is named by the calls that sample it (every third offset) only."""
    stride = 16
    mains = [torch.randn(n * BLOCK, generator=torch.Generator().manual_seed(n)) for n in (1, 3, 15)]
    params = [m.to(torch.bfloat16) for m in mains]
    params[1][BLOCK + 4] += 1.0  # run 1 of the 3-run param

    report = WeightReport(event="test")
    check = ShardCheck(report, atol=0.0, stride=stride, offset=offset, budget_bytes=64 << 20)
    for i, (p, m) in enumerate(zip(params, mains, strict=True)):
        check.add(f"p{i}", p, Reader(p), Owned(m, 0, m.numel(), torch.bfloat16), mxfp8=False)
    check.finish(max_names=5)
    assert [s.elements for s in check.slots] == [BLOCK] * 3, [s.elements for s in check.slots]
    assert report.params_checked == 3 and report.elements_checked == 3 * BLOCK
    sampled = first_sampled(offset, stride, 3) == 1
    assert [m.name for m in report.shard_mismatches] == (["p1"] if sampled else []), report.message()
