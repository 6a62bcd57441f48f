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


# ------------------------------------- the device-side selection equals the host arithmetic
def _shards(rows: int, last: int) -> list[tuple[int, int]]:
    """Owned slices: the whole param; from mid-row to mid-row; a few blocks (fewer than most
    strides); and ones of no whole block."""
    numel = rows * last
    mid = last // 2 + 1
    return [
        (0, numel),
        (mid, numel - mid),
        (last + 3, last + 3 + 5 * BLOCK),
        (2 * last, 2 * last + BLOCK + 1),
        (numel - BLOCK + 1, numel),
    ]


@pytest.mark.parametrize("last", [64, 96, 45, 128, 256, 33, 1000])
@pytest.mark.parametrize("stride", (1, 2, 3, 16, 64))
def test_phased_blocks_are_the_host_arithmetics_at_every_phase(last: int, stride: int) -> None:
    """Issue 32.1: one plan's sampled blocks, computed on the device from the phase tensor, are
    exactly ``mxfp8_blocks``' at every phase (and its element counts): ragged rows, slices from
    mid-row, slices of fewer blocks than the stride, rows of a multiple of 128 elements at
    stride > 1. Where a phase has one block fewer, the fixed shape repeats that phase's own
    last block, never another phase's. Parts (a batch's split) read the same; so do the scales,
    unpadded and padded."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_mxfp8

    rows = 12
    param = torch.empty(rows, last)
    per_row = -(-last // BLOCK)
    flat = torch.arange(rows * last, dtype=torch.int64) + 1  # element i reads i + 1; padding 0
    for cols in (per_row, per_row + 3):
        scales = torch.arange(rows * cols, dtype=torch.int64)
        for s, e in _shards(rows, last):
            phase = Phase(stride)
            blocks, whole = sampled_mxfp8(param, s, e, phase)
            phase.reserve(flat.device, blocks.count)
            for offset in range(2 * stride):
                old, old_whole = mxfp8_blocks(param, s, e, offset, stride)
                assert whole == old_whole
                phase.set(offset)
                phase.begin()
                assert blocks.at(offset % stride) == old and blocks.elements() == old.elements()
                if old.count == 0:
                    assert blocks.count == 0
                    continue
                got = blocks.take(flat[s:e], -s)
                want = old.take(flat[s:e], -s)
                assert got.shape[0] in (old.count, old.count + 1), (got.shape, old.count)
                assert torch.equal(got[: old.count], want), (s, e, offset)
                assert torch.equal(got[old.count :], want[-1:].expand(got.shape[0] - old.count, -1))
                got_s, want_s = blocks.take_scales(scales, cols), old.take_scales(scales, cols)
                assert torch.equal(got_s[: old.count], want_s) and (got_s[old.count :] == want_s[-1]).all()
                parts = [blocks.part(lo, min(3, blocks.count - lo)) for lo in range(0, blocks.count, 3)]
                assert torch.equal(torch.cat([p.take(flat[s:e], -s) for p in parts]), got)


@pytest.mark.parametrize("stride", (2, 16))
def test_phased_runs_are_the_host_arithmetics_at_every_phase(stride: int) -> None:
    """The same for bf16 params' runs of 32 counted from the shard start (and their short run)."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_runs

    flat = torch.arange(10_000, dtype=torch.int64)
    for s, e in ((0, 64 * BLOCK), (37, 37 + 17 * BLOCK + 5), (100, 100 + 3 * BLOCK), (5, 20)):
        phase = Phase(stride)
        blocks, tail = sampled_runs(s, e, phase)
        phase.reserve(flat.device, blocks.count)
        for offset in range(stride):
            old, old_tail = runs(s, e, offset, stride)
            phase.set(offset)
            phase.begin()
            assert tail == old_tail and blocks.at(offset) == old
            if old.count:
                got, want = blocks.take(flat), old.take(flat)
                assert torch.equal(got[: old.count], want) and (got[old.count :] == want[-1]).all()
                assert got.shape[0] in (old.count, old.count + 1)
                got, want = blocks.take(flat[s:e], -s), old.take(flat[s:e], -s)
                assert torch.equal(got[: old.count], want)


def test_a_phase_advanced_behind_a_replay_is_the_next_calls_with_no_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The phase tensor is readied for the call after a replay (``Phase.advance``, queued behind
    it), so a job's next call, at the next offset, launches nothing before its replay; the
    replayed call's own host phase stays; any other offset is filled as before."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase

    fills: list[int] = []
    fill = torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "fill_", lambda t, v: (fills.append(int(v)), fill(t, v))[1])
    cpu = torch.device("cpu")
    phase = Phase(16, 15)
    phase.reserve(cpu, 4)
    held = phase.tensor(cpu)
    phase.advance()  # after the call at offset 15: the next is 16, phase 0
    assert (phase.value, int(held), fills) == (15, 0, [0])
    phase.set(16)
    assert (phase.value, int(held), fills) == (0, 0, [0])  # nothing launched
    phase.advance()
    phase.set(7)  # not the next offset: filled
    assert (phase.value, int(held), fills) == (7, 7, [0, 1, 7])
    phase.set(7)  # the same phase again, held already
    assert fills == [0, 1, 7]


def test_a_plans_slices_of_one_geometry_share_their_blocks_and_no_other_does() -> None:
    """A plan's first call works out each slice's sampled blocks once per geometry
    (``Phase.slice``): what it gives is ``sampled_mxfp8`` / ``sampled_runs`` of that slice, the
    same object for another param of that row length and range (a model's layers), and never
    another geometry's: params of one size with other row lengths (whose scale rows differ), or
    other ranges."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_mxfp8, sampled_runs

    phase = Phase(16)
    params = [torch.empty(4, 96), torch.empty(3, 128), torch.empty(6, 64), torch.empty(4, 96)]
    for s, e in ((0, 384), (32, 352), (40, 300)):
        for param in params:
            assert phase.slice(param, s, e) == sampled_mxfp8(param, s, e, Phase(16)), (param.shape, s, e)
        assert phase.slice(None, s, e) == sampled_runs(s, e, Phase(16))
        assert phase.slice(params[0], s, e) is phase.slice(params[3], s, e)
        assert phase.slice(params[0], s, e)[0].last == 96 and phase.slice(params[1], s, e)[0].last == 128


def test_a_reserved_ramp_grows_only_where_a_param_needs_more() -> None:
    """Most params of a plan need no longer ramp than the first did: reserving again is then
    nothing; a longer need still grows it, on each device asked for."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase

    cpu, meta = torch.device("cpu"), torch.device("meta")
    phase = Phase(16)
    phase.reserve(cpu, 10)
    ramp = phase._ramps[cpu]
    phase.reserve(cpu, 4)
    assert phase._ramps[cpu] is ramp and ramp.numel() == 10
    phase.reserve(meta, 4)
    assert phase._ramps[meta].numel() == 4 and phase.tensor(meta).device == meta
    phase.reserve(cpu, 30)
    assert phase._ramps[cpu].numel() >= 30
