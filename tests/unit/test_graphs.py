"""The process-wide CUDA-graph capture state of the shard check (verify/graphs.py).

No GPU here: ``torch.cuda``'s graph, stream and pool calls are replaced by recorders, which is
all this module drives. What it promises (its docstring): a capture that fails raises
:class:`Uncapturable` with the reason, after the capture was ended and the caller's stream
waited, and turns captures off for the process (``refusal`` then gives that reason);
``MXFP8_VERIFY_CUDA_GRAPH=0`` turns them off from the start; every capture on a device uses one
side stream and one memory pool. No test of the suite captures a real graph (CI has no GPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.verify import graphs


class _Calls:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []


class _Stream:
    def __init__(self, calls: _Calls, name: str) -> None:
        self.calls, self.name = calls, name

    def wait_stream(self, other: _Stream) -> None:
        self.calls.log.append(("wait", (self.name, other.name)))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    calls = _Calls()
    caller = _Stream(calls, "caller")
    made: list[int] = []

    # torch's private pools, as far as captures rely on them: a graph holds its pool until it is
    # collected, and a capture naming a pool whose graphs are all gone fails the allocator's
    # internal assert (CUDACachingAllocator's beginAllocateToPool: use_count > 0).
    uses: dict[int, int] = {}

    class Graph:
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            calls.log.append(("begin", (pool, capture_error_mode)))
            if uses.get(id(pool)) == 0:
                raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
            uses[id(pool)] = uses.get(id(pool), 0) + 1
            self.pool = pool

        def __del__(self) -> None:
            if hasattr(self, "pool"):
                uses[id(self.pool)] -= 1

        def capture_end(self) -> None:
            calls.log.append(("end", None))

    def new_stream() -> _Stream:
        made.append(1)
        return _Stream(calls, f"side{len(made)}")

    @contextlib.contextmanager
    def on(stream: _Stream):
        calls.log.append(("on", stream.name))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: caller)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.log.append(("undo", d)), raising=False
    )
    monkeypatch.setattr(graphs, "_POOLS", {})
    monkeypatch.setattr(graphs, "_LIVE", {})
    monkeypatch.setattr(graphs, "_STREAMS", {})
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.delenv("MXFP8_VERIFY_CUDA_GRAPH", raising=False)
    return calls


def test_captures_are_allowed_until_turned_off(cuda: _Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    assert graphs.refusal() == ""
    monkeypatch.setenv("MXFP8_VERIFY_CUDA_GRAPH", "0")
    assert graphs.refusal() == "MXFP8_VERIFY_CUDA_GRAPH=0"


def test_a_capture_returns_the_graph_and_what_was_recorded(cuda: _Calls) -> None:
    graph, out = graphs.capture(lambda: "verdicts")
    assert out == "verdicts" and isinstance(graph, torch.cuda.CUDAGraph)
    names = [name for name, _ in cuda.log]
    assert names == ["wait", "on", "begin", "end", "wait"]
    assert cuda.log[0][1] == ("side1", "caller") and cuda.log[-1][1] == ("caller", "side1")
    assert cuda.log[2][1][1] == "thread_local"  # another thread's CUDA work does not break it
    assert graphs.refusal() == ""


def test_every_capture_on_a_device_shares_one_stream_and_one_pool(cuda: _Calls) -> None:
    kept = [graphs.capture(lambda: None), graphs.capture(lambda: None)]  # noqa: F841 - alive
    pools = [args[0] for name, args in cuda.log if name == "begin"]
    streams = {args[0] for name, args in cuda.log if name == "wait" and args[0] != "caller"}
    assert len(pools) == 2 and pools[0] is pools[1] and pools[0] is not None
    assert streams == {"side1"}


def test_a_capture_after_every_graph_of_the_pool_is_gone_takes_a_new_pool(cuda: _Calls) -> None:
    """Dropped plans (a new layout, another job in the process) free their graphs; the pool they
    shared is then spent, and naming it again failed every later capture with the allocator's
    internal assert (measured on an H200: every plan eager after the first was dropped)."""
    import gc

    first, _ = graphs.capture(lambda: None)
    del first
    gc.collect()
    second, out = graphs.capture(lambda: "verdicts")  # raised Uncapturable with the spent pool
    assert out == "verdicts" and graphs.refusal(["a write path"]) == ""
    pools = [args[0] for name, args in cuda.log if name == "begin"]
    assert len(pools) == 2 and pools[0] is not pools[1]
    third, _ = graphs.capture(lambda: None)  # while ``second`` lives, its pool is shared
    assert [args[0] for name, args in cuda.log if name == "begin"][-1] is pools[1]


def test_a_failed_capture_is_undone_and_turns_captures_off_for_its_write_paths(cuda: _Calls) -> None:
    """Off for every plan holding one of the failed plan's write paths; a plan of other types
    (unrelated to the write that synced with the host) is still captured (issue 32.1)."""

    def record() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    failed = {("mxfp8", "HostSyncingType")}
    with pytest.raises(graphs.Uncapturable, match="not capturable.*RuntimeError.*stream is capturing") as err:
        graphs.capture(record, failed)
    names = [name for name, _ in cuda.log]
    assert names[:4] == ["wait", "on", "begin", "end"]  # the capture was ended ...
    assert ("wait", ("caller", "side1")) in cuda.log  # ... the caller waits for the side stream ...
    assert ("undo", 0) in cuda.log  # ... and the pool no longer takes the stream's allocations
    assert graphs.refusal(failed | {("bf16", "Tensor")}) == str(err.value)  # a plan holding that path
    assert graphs.refusal({("mxfp8", "AnotherType")}) == ""  # an unrelated plan may capture
    graph, out = graphs.capture(lambda: "verdicts", {("mxfp8", "AnotherType")})
    assert out == "verdicts"


# ----------------------------------------------- one captured plan serves every sampled phase
class _Replaying:
    """A stand-in for a captured graph on CPU: its replay runs what was recorded again, with the
    check's host-side phase held at its value at capture (a real graph replays kernels whose
    Python arguments were fixed then), so only what the recorded work reads from tensors, the
    phase tensor among them, follows the phase of the call."""

    def __init__(self, record: Any, out: torch.Tensor, check: Any) -> None:
        self.record, self.out, self.check = record, out, check
        self.phase, self.value = check.phase, check.phase.value
        self.replays = 0

    def replay(self) -> None:
        live = self.phase.value
        self.phase.value = self.value
        self.check.verdicts = []  # what the recording appends to (read back from ``out``)
        try:
            self.out.copy_(self.record())
        finally:
            self.phase.value = live
        self.replays += 1


def _shard_params(wide: tuple[int, int] = (64, 256)) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """TE-shaped params, each block at its own scale: ``wide`` (rows, row length: by default 512
    blocks, a multiple of the stride), and ragged rows of 96 (30 blocks: later phases have one
    block fewer)."""
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer

    out = []
    for name, rows, last in (("wide", *wide), ("ragged", 10, 96)):
        gen = torch.Generator().manual_seed(last)
        values = torch.randn(rows, last, generator=gen)
        exponents = torch.randint(-8, 9, (rows, -(-last // 32)), generator=gen).float()
        values *= torch.exp2(exponents).repeat_interleave(32, dim=1)[:, :last]
        values = values.to(torch.bfloat16)
        param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
        out.append((name, param, values.float().reshape(-1)))
    return out


@pytest.mark.parametrize("fused_on", ["1", "0", "own"])
def test_a_captured_plan_replays_at_every_phase_and_compares_that_phases_blocks(
    monkeypatch: pytest.MonkeyPatch, fused_on: str
) -> None:
    """Issue 32.1: the sampled phase is data. The plan is captured once, right after its first
    (eager) call, and launched once there (a graph's first launch uploads it: not the job's
    second call's cost); every later call, the job's second included, replays that graph; a
    corrupted scale of a block sampled only at phase 11 is found at the calls of phase 11 and at
    no other, with the phase's own element counts."""
    from mbridge_mxfp8_plugin.verify import fused
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import Reader, reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.sampling import mxfp8_blocks, runs
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    if fused_on != "0" and not fused.available(torch.device("cpu")):
        pytest.skip("no fused kernel here")
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0" if fused_on == "0" else "1")  # "0": no kernel at all
    if fused_on == "own":  # the kernels on, the TE-rule judge off: the type's own write judges
        monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.setattr(graphs, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    made: list[_Replaying] = []

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        out = record()
        made.append(_Replaying(record, out, check))
        return made[-1], out

    monkeypatch.setattr(graphs, "capture", capture)
    stride, params = 16, _shard_params()
    check = ShardCheck(WeightReport(event="t"), atol=0.0, stride=stride, offset=0, budget_bytes=64 << 20)
    for name, param, main in params:
        reader = reader_for(param)
        check.add(name, param, reader, Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    plain_main = torch.randn(37 * 32 + 5, generator=torch.Generator().manual_seed(3))  # a bf16 param
    plain = plain_main.to(torch.bfloat16)
    check.add("plain", plain, Reader(plain), Owned(plain_main, 0, plain.numel(), torch.bfloat16), mxfp8=False)
    check.finish(max_names=5)  # the first call: eager, then recorded and launched once (unread)
    assert len(made) == 1 and made[0].replays == 1
    tables = [s.items for one in check._launches.values() if one is not None for s in one.segments]
    assert len(tables) == (0 if fused_on == "0" else 2)  # the params' launch and the bf16 param's
    assert len({t.untyped_storage().data_ptr() for t in tables}) <= 1  # sent in one copy
    launches = _count_launches(monkeypatch)
    _, wide, _ = params[0]
    wide._rowwise_scale_inv[5, 3] += 1  # global block 43: sampled at phase 43 % 16 == 11 only
    found = []
    for offset in range(1, 2 * stride + 1):
        report = WeightReport(event="t")
        check.restart(report, offset)
        check.finish(max_names=5)
        phase = offset % stride
        want = sum(mxfp8_blocks(p, 0, p.numel(), offset, stride)[0].elements() for _, p, _ in params)
        want += runs(0, plain.numel(), offset, stride)[0].count * 32
        assert report.elements_checked == want, (offset, report.elements_checked, want)
        if not report.ok:
            assert [m.name for m in report.shard_mismatches] == ["wide"], report.message()
            assert report.shard_mismatches[0].elements == 32
            found.append(phase)
    assert found == [11, 11], found
    plain[5 * 32 + 1] += 1.0  # run 5 of the bf16 param: sampled at phase 5 (37 runs) only
    found = []
    for offset in range(stride):
        report = WeightReport(event="t")
        check.restart(report, offset)
        check.finish(max_names=5)
        found += [(offset, m.name) for m in report.shard_mismatches]
    assert found == [(5, "plain"), (11, "wide")], found
    assert len(made) == 1 and made[0].replays == 1 + 3 * stride  # one graph, replayed by every later call
    if fused_on == "1":  # the TE-shaped params (one batch) are one launch per call, not one each,
        # and so are the bf16 param's compares (no gathers)
        assert [b.key in check.fused for b in check.planned] == [True, False]
        assert len(check.planned[0].items) == 2
        want = {"items_kernel": 3 * stride, "kernel": 0, "values_kernel": 3 * stride, "gathers": 0,
                "gather_kernel": 0, "compare_kernel": 0, "byte_gathers": 0}  # fmt: skip
        assert launches == want, launches  # one of each per replay
    elif fused_on == "own":  # the own-write batch: a gather and a compare launch per replay, no
        # index_select (the param's codes and scale bytes are read where they lie)
        assert [b.key in check.fused for b in check.planned] == [False, False]
        assert len(check.planned[0].items) == 2
        want = {"items_kernel": 0, "kernel": 0, "values_kernel": 3 * stride, "gathers": 0,
                "gather_kernel": 3 * stride, "compare_kernel": 3 * stride, "byte_gathers": 0}  # fmt: skip
        assert launches == want, launches
    else:  # per replay a gather of each param's main shard and one of the bf16 param's values
        assert launches["gathers"] == (3 + 1) * 3 * stride, launches


@pytest.mark.parametrize("stride", [16, 1])
@pytest.mark.parametrize("templates", ["grouped", "few", "off"])
def test_an_own_write_key_of_many_batches_is_recorded_once_and_replayed_batch_by_batch(
    monkeypatch: pytest.MonkeyPatch, templates: str, stride: int
) -> None:
    """Issue 32.3: a full check at 4B is a few hundred own-write batches, and recording the
    type's write for each cost 3-7x the eval transition at the plan's first call. With a template
    (``grouped``: groups of two here) the capture records a group of batches once per key
    (``off``: every batch, the cost it removes), and each replay compares every batch of the key
    from its own table: a scale corrupted in the key's fourth batch and one in its last, shorter
    batch are found at their phases and no other, with each phase's element counts; no other
    batch is flagged (a kernel's false flag costs only a re-judge by value, which would hide a
    batch read from the wrong tensors). A key of no more batches than a group (``few``: the
    default group of eight) is recorded in the plan's graph, as with templates off: the same
    writes recorded, and no graph launch of its own at each call."""
    from mbridge_mxfp8_plugin.verify import _templates, fused, reference, shard
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.sampling import mxfp8_blocks

    if not fused.available(torch.device("cpu")):
        pytest.skip("no gather kernel here (TRITON_INTERPRET)")
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "1")
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")  # the type's own write judges
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.setattr(graphs, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    if templates == "off":
        monkeypatch.setattr(shard, "plan_templates", lambda planned, made, tables: [])
    if templates == "grouped":
        monkeypatch.setattr(_templates, "_GROUP", 2)
    writes, recorded, made = [0], [], []
    codes = reference.Reference.codes

    def counted(self: Any, rows: torch.Tensor, k: int) -> Any:
        writes[0] += 1
        return codes(self, rows, k)

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        before = writes[0]
        out = record()
        recorded.append(writes[0] - before)
        made.append(_Replaying(record, out, check))
        return made[-1], out

    monkeypatch.setattr(reference.Reference, "codes", counted)
    tabled, gather_launch, launched = [0], fused.gather_launch, {}

    def tabling(*args: Any, **kwargs: Any) -> Any:
        tabled[0] += 1
        launched[id(args[0][0])] = one = gather_launch(*args, **kwargs)  # by the batch's first item
        return one

    monkeypatch.setattr(fused, "gather_launch", tabling)
    monkeypatch.setattr(graphs, "capture", capture)
    check = shard.ShardCheck(WeightReport(event="t"), atol=0.0, stride=stride, offset=0, budget_bytes=8 << 10)
    params = _shard_params(wide=(128, 512))  # 2048 blocks: at 1/16 four batches of 32, ragged a fifth
    for name, param, main in params:
        check.add(name, param, reader_for(param), Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    batches = len(check.planned)
    assert batches >= 5 and len({b.key for b in check.planned}) == 1
    group = 2 if templates == "grouped" else 8  # batches in a row per replay, then one for the rest
    rest = [1] if batches % group else []
    templated = templates != "off" and batches > group  # at 1/16, ``few`` is five batches: none
    assert len(check.templates) == int(templated)
    assert templates != "few" or stride == 1 or batches <= group  # the case it pins
    assert recorded == ([0, group, *rest] if templated else [batches])  # the plan's graph keeps none
    # A templated batch's own tables are never sent (its rows are in the template's), and it has
    # no launch of its own to be taken for one; every other batch's tables are on the device.
    templated_items = {id(b.items[0]) for t in check.templates for b in t.batches}
    alone = {id(b.items[0]) for b in check.planned} - templated_items
    sent = {i: all(s.items is not None for s in one.segments) for i, one in launched.items()}
    assert sent == {i: i in alone for i in launched}, sent
    assert all(id(b) not in check._launches for t in check.templates for b in t.batches)
    (_, wide, _), (_, ragged, _) = params
    wide._rowwise_scale_inv[100, 11] += 1  # block 1611: phase 11, in wide's fourth batch at 1/16
    ragged._rowwise_scale_inv[2, 1] += 1  # block 7: phase 7, in the plan's last, shorter batch
    judged, attribute = [], check.attribute  # a batch the replay flags is judged again by value
    monkeypatch.setattr(check, "attribute", lambda batch: (judged.append(batch), attribute(batch))[1])
    found = []
    for offset in range(1, stride + 1):
        report = WeightReport(event="t")
        check.restart(report, offset)
        check.finish(max_names=5)
        want = sum(mxfp8_blocks(p, 0, p.numel(), offset, stride)[0].elements() for _, p, _ in params)
        assert report.elements_checked == want, (offset, report.elements_checked, want)
        found += [(offset % stride, m.name, m.elements) for m in report.shard_mismatches]
    assert sorted(found) == (
        [(0, "ragged", 32), (0, "wide", 32)] if stride == 1 else [(7, "ragged", 32), (11, "wide", 32)]
    )
    assert len(judged) == 2  # exact verdicts: only the two corrupted batches were flagged
    assert tabled[0] == batches  # each batch's tables made once, at the plan's first call
    if templated:  # per call a replay per group of batches, and one per batch of the rest
        assert made[1].replays == batches // group * (1 + stride)
        assert not rest or made[2].replays == batches % group * (1 + stride)


def test_a_template_batch_with_fewer_segments_compares_each_item_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template launches every segment the key's largest batch has; in a batch with fewer, the
    missing segment's table is padding, and its programs must find no item there (a guard row).
    Without it they take the row before it, the last item of the batch's full segment, at block
    indices counted from a later program: before its first block (out of bounds: the interpreter
    segfaults, a GPU faults) and its blocks again (counted twice). Segments of 4 rows (the
    kernel's bound lowered): the first batch is ``cap`` one-block params (two segments or more),
    the second four params that fill it to the cap (one segment, no tile padding row after them)."""
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
    from mbridge_mxfp8_plugin.verify import _program_rows, _templates, fused, shard
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport

    if not fused.available(torch.device("cpu")):
        pytest.skip("no gather kernel here (TRITON_INTERPRET)")
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "1")
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.setattr(graphs, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_program_rows, "MAX_ROWS", 4)
    monkeypatch.setattr(_templates, "_GROUP", 1)  # a template of the two batches

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        out = record()
        return _Replaying(record, out, check), out

    monkeypatch.setattr(graphs, "capture", capture)

    def add(check: Any, blocks: list[int]) -> list[torch.Tensor]:
        made = []
        for i, n in enumerate(blocks):
            gen = torch.Generator().manual_seed(i)
            values = (torch.randn(1, 32 * n, generator=gen) * 2.0 ** (i % 7)).bfloat16()
            made.append(TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values))
            main = values.float().reshape(-1)
            check.add(
                f"p{i}", made[-1], reader_for(made[-1]), Owned(main, 0, main.numel(), torch.bfloat16), True
            )
        return made

    probe = shard.ShardCheck(WeightReport(event="t"), atol=0.0, stride=1, offset=0, budget_bytes=8 << 10)
    add(probe, [1])
    cap = next(iter(probe.capacity.values()))  # blocks per batch
    assert cap > 4 and cap % 32 == 0
    check = shard.ShardCheck(WeightReport(event="t"), atol=0.0, stride=1, offset=0, budget_bytes=8 << 10)
    params = add(check, [1] * cap + [cap // 4] * 4)
    check.finish(max_names=5)
    assert [len(b.items) for b in check.planned] == [cap, 4] and len(check.templates) == 1
    assert check.report.ok and check.templates[0].counts.tolist() == [0, 0]
    params[-1]._rowwise_scale_inv[0, 0] += 1  # the second batch's last item, its segment's last row
    report = WeightReport(event="t")
    check.restart(report, 1)
    check.finish(max_names=5)
    assert check.templates[0].counts.tolist() == [0, 1]  # one differing scale byte, compared once
    assert [m.name for m in report.shard_mismatches] == [f"p{cap + 3}"]


def test_a_launch_left_unread_is_not_taken_for_the_next_calls_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay launched ahead of a call's host work (``verify_weights`` launches it before the
    fingerprint) whose call then never finished: the next call replays its own phase, not that
    launch's (a block corrupted since, at the next call's phase, is found)."""
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0")
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.setattr(graphs, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        out = record()
        return _Replaying(record, out, check), out

    monkeypatch.setattr(graphs, "capture", capture)
    check = ShardCheck(WeightReport(event="t"), atol=0.0, stride=16, offset=0, budget_bytes=64 << 20)
    (name, wide, main), _ = _shard_params()
    check.add(name, wide, reader_for(wide), Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    check.launch(1)  # ... and that call fails before it finishes
    wide._rowwise_scale_inv[1, 3] += 1  # block 11 (8 a row): sampled at phase 11 only
    report = WeightReport(event="t")
    check.restart(report, 11)
    check.finish(max_names=5)
    assert not report.ok and [m.name for m in report.shard_mismatches] == ["wide"], report.message()


def _first_call_setup(
    monkeypatch: pytest.MonkeyPatch, fail_first: bool = False
) -> tuple[list[Any], list[Any]]:
    """Graphs stood in on CPU (no kernels): the captures made (their ``paths``), and the check's
    eager runs, recorded; ``fail_first``: the first capture fails as a first compile could."""
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0")
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.setattr(graphs, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    captures: list[Any] = []
    eager: list[Any] = []

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        captures.append(tuple(paths))
        if fail_first and len(captures) == 1:
            raise graphs.Uncapturable("not capturable (a first compile)")
        out = record()
        cells = [c.cell_contents for c in record.__closure__ or ()]
        return _Replaying(record, out, next(c for c in cells if isinstance(c, ShardCheck))), out

    run_eager = ShardCheck._run_eager

    def counted(self: Any) -> None:
        eager.append(1)
        run_eager(self)

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(ShardCheck, "_run_eager", counted)
    return captures, eager


def _values_param() -> tuple[torch.Tensor, torch.Tensor]:
    """The kit's value-holding MXFP8 type (its reading is self-checked at its first compare)."""
    from mbridge_mxfp8_plugin.common.mxfp8_cast import mxfp8_quantize
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    param = mxfp8_quantize(values).to(torch.bfloat16).as_subclass(EmulatedMXFP8Tensor)
    return param, values.float().reshape(-1)


@pytest.mark.parametrize("kind", ["codes", "values"])
def test_a_settled_plans_first_call_is_recorded_with_no_eager_run_before_it(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One host pass at a plan's first call where none of its compares syncs with the host there:
    a codes type's reading was settled by its probe's write. A value-holding MXFP8 type's is
    self-checked at its first compare (a host sync, which a capture refuses), so its plan runs
    eagerly first and is recorded after. Either way the second call replays."""
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    captures, eager = _first_call_setup(monkeypatch)
    param, main = _values_param() if kind == "values" else _shard_params()[0][1:]
    check = ShardCheck(WeightReport(event="t"), atol=0.0, stride=16, offset=0, budget_bytes=64 << 20)
    check.add("w", param, reader_for(param), Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    assert check.report.ok and check.report.elements_checked > 0, check.report.message()
    assert len(captures) == 1 and check.graph is not None
    assert len(eager) == (0 if kind == "codes" else 1), eager
    report = WeightReport(event="t")
    check.restart(report, 1)
    check.finish(max_names=5)
    assert report.ok and len(eager) == (0 if kind == "codes" else 1) and len(captures) == 1


def test_a_first_recording_that_fails_runs_eagerly_and_is_recorded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture with no eager run before it may fail where one after it would not (a kernel's
    first compile, a type's first write): that failure does not turn captures off for the plan's
    write paths; the call runs eagerly and is recorded after, as a plan's first call otherwise is."""
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    captures, eager = _first_call_setup(monkeypatch, fail_first=True)
    (_, param, main), _ = _shard_params()
    check = ShardCheck(WeightReport(event="t"), atol=0.0, stride=16, offset=0, budget_bytes=64 << 20)
    check.add("w", param, reader_for(param), Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    assert check.report.ok and check.report.elements_checked > 0, check.report.message()
    assert eager == [1] and len(captures) == 2 and captures[0] == () and captures[1], captures
    assert check.graph is not None and not check.no_graph and graphs.refusal(captures[1]) == ""


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Launches of the fused kernels from now on, by name (a launch indexes the kernel by its grid),
    and the gathers of the values path (``index_select``)."""
    from mbridge_mxfp8_plugin.verify import _te_rule_kernel

    counts = {"items_kernel": 0, "kernel": 0, "values_kernel": 0, "gathers": 0}
    counts.update(gather_kernel=0, compare_kernel=0, byte_gathers=0)

    class Counted:
        def __init__(self, name: str, module: Any, attr: str) -> None:
            self.name, self.kernel = name, getattr(module, attr)

        def __getitem__(self, grid: Any) -> Any:
            counts[self.name] += 1
            return self.kernel[grid]

    for name in ("items_kernel", "kernel"):
        monkeypatch.setattr(_te_rule_kernel, name, Counted(name, _te_rule_kernel, name))
    if importlib.util.find_spec("triton") is not None:
        from mbridge_mxfp8_plugin.verify import _values_kernel

        values = Counted("values_kernel", _values_kernel, "items_kernel")
        monkeypatch.setattr(_values_kernel, "items_kernel", values)
        from mbridge_mxfp8_plugin.verify import _gather_kernel

        gather = Counted("gather_kernel", _gather_kernel, "items_kernel")
        monkeypatch.setattr(_gather_kernel, "items_kernel", gather)
        compare = Counted("compare_kernel", _gather_kernel, "compare_kernel")
        monkeypatch.setattr(_gather_kernel, "compare_kernel", compare)
    select = torch.Tensor.index_select

    def index_select(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts["gathers"] += self.dtype == torch.bfloat16 or self.dtype == torch.float32
        counts["byte_gathers"] += self.dtype == torch.uint8  # codes and scale bytes
        return select(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    return counts
