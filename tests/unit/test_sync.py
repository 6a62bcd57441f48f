"""The engine's state machine in one process, against fakes of megatron-core that behave as each
release does (tests/harness/fake_core.py): which event stages, gathers, writes back or resets.

Expectations come from docs/upstream.md's defect table, not from the engine: an eval must read the
current main params (B1/B2), the step after a forced sync must gather and leave a zeroed buffer
(C), a checkpoint save must capture the current weights, a gather in flight is never reset or
re-dispatched, an eval without an optimizer keeps the loaded weights, and where the loop and
core already do everything (core 0.19 + a loop that stages) the engine adds nothing. Each test
that shows a fix first shows the fakes reproduce the defect without the engine, so it can fail.
"""

from __future__ import annotations

import pytest
import torch
from harness.fake_core import RELEASES, N, make_job

from mbridge_mxfp8_plugin.engine import applies
from mbridge_mxfp8_plugin.engine.sync import ParamSyncEngine, SyncStats
from mbridge_mxfp8_plugin.errors import MXFP8UsageError

pytestmark = pytest.mark.parametrize("release", RELEASES, ids=[r.name for r in RELEASES])


def _engine(job, *, optimizer=True):
    engine = ParamSyncEngine([job.chunk], job.opt if optimizer else None, behaviour=job.release.behaviour())
    engine.prepare()
    return engine


def _train_step(job, engine=None, *, value: float) -> None:
    """Bridge's / Megatron-LM's step: zero the buffer, stage while pre-hooks are on, the pre-hooks'
    gather, then the optimizer step (new main params, gradients in the shared buffer)."""
    if engine is not None:
        engine.step_started()
    job.chunk.zero_grad_buffer()
    if job.chunk.remove_forward_pre_hook_handles:
        job.opt._copy_main_params_to_param_buffer()
    for group in job.groups:
        group.finish_param_sync()
    job.opt.step(value)


def _eval(job, engine=None, *, stage_ahead: bool = True) -> list[float]:
    """The loop's eval: forced sync (pre-hooks off), read the weights, pre-hooks back on."""
    if engine is not None and stage_ahead:
        engine.before_forced_sync()
    job.chunk.disable_forward_pre_hook()
    if engine is not None:
        engine.before_eval()
    seen = job.weights()
    job.chunk.enable_forward_pre_hook()
    if engine is not None:
        engine.after_forced_sync()
    return seen


def test_fakes_show_the_eval_defect_without_the_engine(release):
    job = make_job(release)
    _train_step(job, value=2.0)
    assert _eval(job) != [2.0]  # stale (core < 0.18) or gathered gradients (>= 0.18)


@pytest.mark.parametrize("stage_ahead", [True, False], ids=["staged-ahead", "not-announced"])
def test_eval_reads_the_current_main_params(release, stage_ahead):
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    assert _eval(job, engine, stage_ahead=stage_ahead) == [2.0]


def test_announced_eval_reuses_the_loops_forced_gather(release):
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    engine.before_forced_sync()
    gathers = [g.gathers for g in job.groups]
    job.chunk.disable_forward_pre_hook()
    stats = engine.before_eval()
    assert stats.all_gathers == 0 and [g.gathers for g in job.groups] == [n + 1 for n in gathers]
    # Only a core that does not copy a forced gather back needs the engine's write-back (B1).
    assert (stats.params_written > 0) == (not release.forced_sync_writes_back)


def test_step_after_eval_gathers_and_leaves_no_main_params_in_the_gradients(release):
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    _eval(job, engine)
    gathers = [g.gathers for g in job.groups]
    _train_step(job, engine, value=3.0)
    assert [g.gathers for g in job.groups] == [n + 1 for n in gathers]
    assert job.weights() == [2.0]  # this step's forwards ran on the current weights


def test_fakes_show_defect_c_without_the_engine(release):
    job = make_job(release)
    _train_step(job, value=2.0)
    _eval(job)
    gathers = [g.gathers for g in job.groups]
    job.chunk.zero_grad_buffer()
    job.opt._copy_main_params_to_param_buffer()
    for group in job.groups:
        group.finish_param_sync()
    skipped = [g.gathers for g in job.groups] == gathers
    assert skipped == (not release.has_dispatch_reset)  # C: fixed by core 0.19's staging reset
    if skipped:  # the staged main params stay in the buffer, read as gradients
        assert any(b.param_data.abs().sum() > 0 for g in job.groups for b in g.buckets)


def test_checkpoint_save_captures_the_current_weights(release):
    control = make_job(release)
    _train_step(control, value=2.0)
    control.chunk.disable_forward_pre_hook()
    assert control.weights() != [2.0]  # stale or gathered gradients, as docs/upstream.md records
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    engine.before_forced_sync(save=True)  # no hook runs between this and the save's write
    job.chunk.disable_forward_pre_hook()  # save_checkpoint_and_time's force_param_sync
    assert job.weights() == [2.0]


def test_unannounced_forced_sync_is_not_trusted(release):
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    engine.before_forced_sync()
    job.chunk.disable_forward_pre_hook()  # a save nobody announced (Bridge < 0.5)
    engine.forced_sync_unobserved()
    job.chunk.disable_forward_pre_hook()  # the eval's own forced sync gathers what is left
    engine.before_eval()
    assert job.weights() == [2.0]


def test_gather_in_flight_is_never_reset_or_redispatched(release):
    job = make_job(release)
    engine = _engine(job)
    group = job.groups[0]
    group.start_param_sync()  # what overlap_param_gather_with_optimizer_step leaves
    handle, gathers, stagings = group.param_gather_handle, group.gathers, job.opt.stagings
    stats = engine.step_started()
    assert stats.groups_reset == 0
    assert engine.stage_main_params() is False and job.opt.stagings == stagings
    assert group.param_gather_handle is handle and group.param_gather_dispatched
    assert group.gathers == gathers and handle.waited == 0


def test_refresh_waits_for_the_gather_in_flight_then_gathers_once_per_group(release):
    job = make_job(release)
    engine = _engine(job)
    _train_step(job, engine, value=2.0)
    job.groups[0].start_param_sync()
    handle = job.groups[0].param_gather_handle
    forced = [g.forced_gathers for g in job.groups]
    stats = engine.refresh_weights()
    assert handle.waited == 1 and stats.all_gathers == len(job.groups)
    assert [g.forced_gathers for g in job.groups] == [n + 1 for n in forced]
    assert job.weights() == [2.0]
    assert all(g.param_gather_dispatched and g.param_gather_handle is None for g in job.groups)


def test_eval_without_optimizer_holds_the_loaded_weights(release):
    job = make_job(release)
    control = make_job(release)
    for group in control.groups:  # a pre-hook gathers the empty buffer over the loaded weights
        group.finish_param_sync()
    assert control.weights() == [0.0]
    engine = _engine(job, optimizer=False)
    stats = engine.before_eval()
    for group in job.groups:
        group.finish_param_sync()
    assert stats.all_gathers == 0 and job.weights() == [1.0]
    assert all(g.gathers == 0 for g in job.groups)
    engine.after_forced_sync()
    if not release.has_dispatch_reset:  # training may start: the next step must gather again
        assert not any(g.param_gather_dispatched for g in job.groups)


def test_stage_for_step_stages_only_when_a_gather_follows(release):
    job = make_job(release)
    engine = _engine(job)
    job.opt.step(2.0)
    job.chunk.zero_grad_buffer()
    job.chunk.disable_forward_pre_hook(param_sync=False)
    assert engine.stage_for_step() is False  # no pre-hook would gather it: it would stay as gradients
    job.chunk.enable_forward_pre_hook()
    assert engine.stage_for_step() is True
    for group in job.groups:
        group.finish_param_sync()
    assert job.weights() == [2.0]


def test_passive_when_core_and_the_loop_stage_themselves(release, monkeypatch):
    monkeypatch.setattr(applies, "probe_live_loop", lambda: True)
    job = make_job(release)
    engine = _engine(job)
    assert engine.loop_stages_itself() == release.has_prepare_for_param_sync
    if not engine.loop_stages_itself():
        return
    assert engine.passive
    _train_step(job, engine, value=2.0)
    job.opt._copy_main_params_to_param_buffer()  # the loop's own prepare_model_params_for_param_sync
    job.chunk.disable_forward_pre_hook()
    stagings = job.opt.stagings
    stats = engine.before_eval()
    assert (stats.all_gathers, stats.params_written) == (0, 0) and job.weights() == [2.0]
    job.chunk.enable_forward_pre_hook()
    assert engine.after_forced_sync().staged is False and job.opt.stagings == stagings


@pytest.mark.parametrize(("live_loop", "overlap"), [(False, True), (None, True), (True, False)])
def test_not_passive_unless_every_condition_holds(release, monkeypatch, live_loop, overlap):
    monkeypatch.setattr(applies, "probe_live_loop", lambda: live_loop)
    job = make_job(release)
    job.opt.config.overlap_param_gather = overlap
    engine = _engine(job)
    assert engine.loop_stages_itself() is False and not engine.passive


def test_step_started_resets_only_where_core_does_not(release):
    job = make_job(release)
    engine = _engine(job)
    job.chunk.disable_forward_pre_hook()
    stats = engine.step_started()
    assert isinstance(stats, SyncStats)
    # Core 0.19 resets when the loop stages (and the engine must not add a second dispatch path).
    assert stats.groups_reset == (0 if release.has_dispatch_reset else len(job.groups))


def test_bucket_groups_include_expert_groups_in_order(release):
    job = make_job(release, groups=1)
    expert = make_job(release, groups=1).groups[0]
    job.chunk.expert_parallel_bucket_groups = [expert]
    engine = ParamSyncEngine([job.chunk], job.opt, behaviour=release.behaviour())
    assert engine.bucket_groups() == [job.groups[0], expert]


def test_prepare_repairs_bucket_offsets_that_ignore_padding(release):
    """Defect A: param_to_index as a naive running sum, the buffer's map padded to 64 elements."""
    job = make_job(release, groups=1)
    bucket = job.groups[0].buckets[0]
    first, second = (
        torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=False) for n in (40, N)
    )
    grad = torch.zeros(2 * N, dtype=torch.float32)
    bucket.params_list, bucket.grad_data = [first, second], grad
    bucket.param_data = grad.view(torch.bfloat16)[: 2 * N]
    bucket.param_to_index = {first: (0, 40), second: (40, 40 + N)}
    job.chunk.buffers[0].param_index_map = {first: (0, 40, 0), second: (N, 2 * N, 0)}
    report = ParamSyncEngine([job.chunk], job.opt, behaviour=release.behaviour()).prepare()
    assert report is not None and len(report.mismatches) == 1
    assert bucket.param_to_index[second] == (N, 2 * N)


def test_refuses_chunks_that_are_not_megatron_ddp(release):
    with pytest.raises(MXFP8UsageError):
        ParamSyncEngine([torch.nn.Linear(2, 2)], None, behaviour=release.behaviour())


def test_fake_layout_is_reuse_mode(release):
    """Guards the fakes: the bf16 param view is the first half of the fp32 grad buffer."""
    job = make_job(release, groups=1)
    b = job.groups[0].buckets[0]
    assert b.param_data.untyped_storage().data_ptr() == b.grad_data.untyped_storage().data_ptr()


# -- passive means passive (issue 20): where core 0.19 and the loop do everything ----------------
def _bytes(job) -> list[torch.Tensor]:
    return [t.detach().clone() for g in job.groups for b in g.buckets for t in (b.grad_data, *b.params_list)]


def _quiet(job, call):
    """Run one engine call; assert it gathered, staged and wrote nothing (by the fakes' counters and
    the buffers' and params' bytes, not only by what the engine says)."""
    gathers, stagings, before = [g.gathers for g in job.groups], job.opt.stagings, _bytes(job)
    stats = call()
    if isinstance(stats, SyncStats):
        assert (stats.all_gathers, stats.staged, stats.params_written, stats.buckets_zeroed) == (
            0,
            False,
            0,
            0,
        )
    assert [g.gathers for g in job.groups] == gathers and job.opt.stagings == stagings
    assert all(torch.equal(a, b) for a, b in zip(_bytes(job), before, strict=True))
    return stats


def _loop_forced_sync(job, *, disable: bool) -> None:
    """Bridge >= 0.6: ``prepare_model_params_for_param_sync`` before every forced sync."""
    job.opt._copy_main_params_to_param_buffer()
    if disable:
        job.chunk.disable_forward_pre_hook()
    else:  # a save's force_param_sync: pre-hooks stay on
        for group in job.groups:
            group.start_param_sync(force_sync=True)


def _passive_engine(release, monkeypatch, job):
    monkeypatch.setattr(applies, "probe_live_loop", lambda: True)
    engine = _engine(job)
    passive = engine.loop_stages_itself()
    # Only a core that writes forced gathers back, resets the dispatch state and stages on request
    # (0.19) may leave the work to a loop that stages; below that the engine must act itself, and
    # the passive contract checked by the callers does not apply.
    assert passive == (release.name == "0.19.2")
    return engine if passive else None


@pytest.mark.parametrize("flags_after_sync", ["synced", "reset"])
def test_passive_engine_does_nothing_in_any_schedule(release, monkeypatch, flags_after_sync):
    """Evals, a periodic save between evals, the final save, the test after training, in Bridge
    0.6's order, with every engine event: each returns having issued no gather, staged nothing and
    written nothing, and every eval still reads the current main params (the loop's doing).
    ``reset``: core or a hook cleared the dispatch flags before the eval event (the engine must
    not take that for a stale gather: trusting flags is what re-gathered on the real loop)."""
    job = make_job(release)
    engine = _passive_engine(release, monkeypatch, job)
    if engine is None:
        return

    def eval_(value: float, event=engine.before_eval) -> None:
        _quiet(job, engine.before_forced_sync)
        _loop_forced_sync(job, disable=True)
        if flags_after_sync == "reset":
            for group in job.groups:
                group.param_gather_dispatched = False
        _quiet(job, event)
        assert job.weights() == [value]
        job.chunk.enable_forward_pre_hook()
        _quiet(job, engine.after_forced_sync)

    for step in range(1, 7):
        _quiet(job, engine.step_started)
        _quiet(job, engine.stage_for_step)
        _train_step(job, value=float(step + 1))
        if step % 2 == 0:
            eval_(float(step + 1))
        if step % 3 == 0:  # a periodic save (no callback before it), then on_checkpoint_save
            _quiet(job, lambda: engine.before_forced_sync(save=True))
            _quiet(job, engine.refresh_for_save)
            _loop_forced_sync(job, disable=False)
            assert job.weights() == [float(step + 1)]
            _quiet(job, engine.after_forced_sync)
    _quiet(job, engine.forced_sync_unobserved)
    _quiet(job, lambda: engine.training_ended(gathered_fresh=None))
    _quiet(job, lambda: engine.training_ended(gathered_fresh=False))
    eval_(7.0)  # the test after training
    assert engine.passive


def test_passive_engine_eval_without_optimizer_only_marks_groups(release, monkeypatch):
    """Defect E stays handled where the engine is otherwise passive: flags only, no byte written."""
    monkeypatch.setattr(applies, "probe_live_loop", lambda: True)
    job = make_job(release)
    engine = _engine(job, optimizer=False)
    assert engine.loop_stages_itself() is False  # nothing is known about the loop without an optimizer
    _quiet(job, engine.before_eval)
    assert all(g.param_gather_dispatched for g in job.groups)


def test_rebinding_an_optimizer_decides_passivity_again(release, monkeypatch):
    job = make_job(release)
    engine = _passive_engine(release, monkeypatch, job)
    if engine is None:
        return
    other = make_job(release)
    other.opt.config.overlap_param_gather = False  # core 0.19 stages only with overlap on
    other.opt.model_chunks = [job.chunk]
    engine.bind_optimizer(other.opt)
    assert not engine.passive


def test_refresh_on_demand_acts_even_when_passive(release, monkeypatch):
    """An export right after a step (no forward since) reads stale params on core 0.19 too: the
    explicit refresh still works where every event is passive."""
    job = make_job(release)
    engine = _passive_engine(release, monkeypatch, job)
    if engine is None:
        return
    _train_step(job, engine, value=5.0)
    assert job.weights() == [1.0]
    stats = engine.refresh_weights(gathered_fresh=False)
    assert stats.all_gathers == len(job.groups) and job.weights() == [5.0]


def test_bridge_checkpoint_save_with_unwrapped_modules_keeps_the_engine(release):
    """Bridge >= 0.5 fires on_checkpoint_save with ``unwrap_model(model)``. Taking those for new
    chunks dropped the engine (and that it was passive) and rebuilt a forgetful one at the next
    hook: the re-gathers of issue 20 on core 0.19 + Bridge 0.6."""
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback

    job = make_job(release)
    job.chunk.module = torch.nn.Linear(1, 1)  # what DDP wraps
    cb = MXFP8ParamSyncCallback(validate=False)
    cb.on_train_start(SimpleNamespace(model=[job.chunk], optimizer=job.opt, state=None))
    engine = cb.engine
    assert engine is not None
    cb.on_checkpoint_save(SimpleNamespace(model=[job.chunk.module], optimizer=job.opt, state=None))
    assert cb.engine is engine and cb.inactive_reason is None
    cb.on_train_step_start(SimpleNamespace(model=[job.chunk], optimizer=job.opt, state=None))
    assert cb.engine is engine
    # modules that are not this job's chunks unwrapped are a different job
    cb.on_checkpoint_save(SimpleNamespace(model=[torch.nn.Linear(1, 1)], optimizer=None, state=None))
    assert cb.engine is None and cb.inactive_reason
