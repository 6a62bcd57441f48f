"""One options contract for the three entry points (Bridge callback, Lightning callback, loop API):
what adapters/session.py does the same way for each (the options, the shared engine, the verify policy).
The options type itself: tests/unit/test_options.py.

Single process: a stand-in for megatron-core's DDP chunk (harness.fake_core) in the affected mode
(reuse + distributed optimizer + overlap, no buckets) is enough for an entry point to build its
engine, so each ``enabled=False`` test has a control in which the same calls do build one and record events.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from harness.fake_core import BucketlessChunk

from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback, MXFP8UsageError, PluginOptions, mxfp8_param_sync

BRIDGE_HOOKS = (
    "on_train_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_eval_start",
    "on_eval_end",
    "on_test_start",
    "on_test_end",
    "on_checkpoint_save",
    "on_train_end",
)


def _disabled_lines(caplog) -> int:
    return sum("disabled" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_bridge_callback_is_inert_when_disabled(caplog, enabled):
    cb = MXFP8ParamSyncCallback(PluginOptions(enabled=enabled))
    context = SimpleNamespace(model=[BucketlessChunk()], optimizer=None, state=None)
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        for hook in BRIDGE_HOOKS * 2:
            getattr(cb, hook)(context)
    if enabled:  # control: the same hooks build an engine and record the evals
        assert cb.engine is not None and cb.history and _disabled_lines(caplog) == 0
    else:
        assert cb.engine is None and not cb.history and cb.inactive_reason == "enabled=False"
        assert _disabled_lines(caplog) == 1 and "active" not in caplog.text.replace("inactive", "")


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_lightning_callback_is_inert_when_disabled(caplog, enabled):
    pytest.importorskip("lightning")
    from mbridge_mxfp8_plugin.adapters.lightning import MXFP8ParamSyncLightningCallback

    chunk = BucketlessChunk()
    cb = MXFP8ParamSyncLightningCallback(PluginOptions(enabled=enabled), model_getter=lambda t, m: [chunk])
    trainer = SimpleNamespace(optimizers=[], max_steps=-1)
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        for _ in range(2):
            cb.on_validation_start(trainer, None)
            cb.on_validation_end(trainer, None)
            cb.on_train_batch_start(trainer, None, None, 0)
            cb.on_megatron_microbatches_start()
            cb.on_train_batch_end(trainer, None, None, None, 0)
            cb.on_train_end(trainer, None)
    if enabled:
        assert cb.engine is not None and cb.history and _disabled_lines(caplog) == 0
        # The fit-start check refuses a job without a Megatron optimizer ...
        with pytest.raises(MXFP8UsageError, match="no Megatron optimizer"):
            cb.on_fit_start(trainer, None)
    else:
        # ... which a disabled callback never looks for.
        cb.on_fit_start(trainer, None)
        assert cb.engine is None and not cb.history and cb.inactive_reason == "enabled=False"
        assert _disabled_lines(caplog) == 1


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_loop_api_is_inert_when_disabled(caplog, enabled):
    chunk = BucketlessChunk()
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        sync = mxfp8_param_sync(chunk, None, PluginOptions(enabled=enabled))
        calls = [sync.step_started, sync.before_eval, sync.after_eval, sync.before_save]
        # close() refreshes from the optimizer's main params, which this control job lacks.
        notes = [call().note for call in calls + ([] if enabled else [sync.close])]
    if enabled:
        assert sync.engine is not None and "inactive" not in notes
    else:
        assert sync.engine is None and sync.inactive_reason == "enabled=False"
        assert set(notes) <= {"inactive", "nothing to prepare", "nothing to refresh"}
        assert _disabled_lines(caplog) == 1


def test_lightning_callback_takes_options_first_and_positionally():
    pytest.importorskip("lightning")
    from mbridge_mxfp8_plugin.adapters.lightning import MXFP8ParamSyncLightningCallback

    options = PluginOptions(repair_alignment=False, stage_for_nemo_steps=False)
    assert MXFP8ParamSyncLightningCallback(options).options == options
    assert MXFP8ParamSyncCallback(options).options == options
    # Keyword overrides take one path in every entry point, and unknown names are refused.
    cb = MXFP8ParamSyncLightningCallback(options, strict=False)
    assert cb.options == PluginOptions(repair_alignment=False, stage_for_nemo_steps=False, strict=False)
    with pytest.raises(MXFP8UsageError, match="not a plugin option: stage_for_nemo"):
        MXFP8ParamSyncLightningCallback(stage_for_nemo=False)
    with pytest.raises(MXFP8UsageError, match="takes a PluginOptions"):
        MXFP8ParamSyncCallback({"enabled": False})


def test_loop_api_refuses_different_options_for_the_same_chunks():
    chunk = BucketlessChunk()
    first = mxfp8_param_sync([chunk], None, PluginOptions(validate=False))
    # The documented second call (save_checkpoint_and_time) names no options: the same object.
    assert mxfp8_param_sync([chunk], None) is first
    assert mxfp8_param_sync([chunk], None, PluginOptions(validate=False)) is first
    with pytest.raises(MXFP8UsageError, match="already set up for these model chunks"):
        mxfp8_param_sync([chunk], None, PluginOptions(validate=False, strict=False))
    with pytest.raises(MXFP8UsageError, match="already set up for these model chunks"):
        mxfp8_param_sync([chunk], None, validate=True)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_verify_policy_raises_or_logs_at_error(caplog, monkeypatch, strict):
    """Session.verify: with the option on, a bad report raises under strict, else one
    ERROR record naming the event; with the option off nothing is checked."""
    import mbridge_mxfp8_plugin.adapters.session as adapter
    import mbridge_mxfp8_plugin.verify as verify
    from mbridge_mxfp8_plugin import MXFP8PluginError
    from mbridge_mxfp8_plugin.verify import ParamMismatch, WeightReport

    calls, samples = [], []

    def fake_verify(chunks, optimizer, *, event, sample, accept_unchecked):
        calls.append(event)
        samples.append(sample)
        return WeightReport(event, shard_mismatches=[ParamMismatch("w", 1.0, 3)], shard_mismatch_count=1)

    monkeypatch.setattr(verify, "verify_weights", fake_verify)
    monkeypatch.setattr(adapter, "distributed_optimizers", lambda opt: [opt])
    chunk, optimizer = BucketlessChunk(), object()
    assert (
        MXFP8ParamSyncCallback(PluginOptions(strict=strict)).session.verify("eval", [chunk], optimizer)
        is None
    )
    assert calls == []  # option off: control
    cb = MXFP8ParamSyncCallback(
        PluginOptions(enabled=False, verify_weights=True, verify_sample=0.25, strict=strict)
    )
    cb.session.verify("on_train_start", [chunk], optimizer, when=False)  # remembers, checks nothing
    assert calls == []
    with caplog.at_level(logging.ERROR, logger="mbridge_mxfp8_plugin"):
        if strict:
            with pytest.raises(MXFP8PluginError, match=r"on_eval_start \(Bridge\): WRONG.*w \(max"):
                cb.session.verify("on_eval_start")
        else:
            report = cb.session.verify("on_eval_start")
            assert report is not None and not report.ok
    assert calls == ["on_eval_start (Bridge)"]
    assert samples == [0.25]  # the option reaches the check
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == (0 if strict else 1)
    if not strict:
        assert "on_eval_start (Bridge): WRONG" in errors[0].getMessage()


@pytest.mark.parametrize("accept", [False, True], ids=["default", "accepted"])
def test_an_unreadable_mxfp8_type_is_a_failure_named_once_unless_accepted(caplog, monkeypatch, accept):
    """A check that could read no MXFP8 weight is NOT CHECKED: under strict it raises like a
    mismatch (never a silent OK), one rank-0 WARNING names the type the first time it is seen,
    and ``verify_accept_unchecked`` takes it as a pass (logged at DEBUG, no raise)."""
    import mbridge_mxfp8_plugin.adapters.session as adapter
    import mbridge_mxfp8_plugin.verify as verify
    from mbridge_mxfp8_plugin import MXFP8PluginError
    from mbridge_mxfp8_plugin.verify import WeightReport

    def fake_verify(chunks, optimizer, *, event, sample, accept_unchecked):
        report = WeightReport(event, params_checked=3, accept_unchecked=accept_unchecked)
        for name in ("w1", "w2"):
            report.add_unchecked(name, "values behind __torch_dispatch__", "OpaqueMXFP8")
        return report

    monkeypatch.setattr(verify, "verify_weights", fake_verify)
    monkeypatch.setattr(adapter, "distributed_optimizers", lambda opt: [opt])
    chunk, optimizer = BucketlessChunk(), object()
    sync = mxfp8_param_sync(
        [chunk], optimizer, enabled=False, verify_weights=True, verify_accept_unchecked=accept
    )
    with caplog.at_level(logging.DEBUG, logger="mbridge_mxfp8_plugin"):
        for event in ("eval 1", "eval 2"):
            if accept:
                report = sync.session.verify(event, [chunk], optimizer)
                assert report is not None and report.ok and report.verdict == "not checked"
            else:
                with pytest.raises(MXFP8PluginError, match=r"NOT CHECKED: 2 of 5 owned params.*OpaqueMXFP8"):
                    sync.session.verify(event, [chunk], optimizer)
    warnings = [r.getMessage() for r in caplog.records if logging.WARNING <= r.levelno < logging.ERROR]
    assert len(warnings) == 1 and "OpaqueMXFP8" in warnings[0] and "docs/verify.md" in warnings[0], warnings


@pytest.mark.parametrize("verdict", ["ok", "wrong", "not checked"])
def test_the_check_is_prepared_at_train_start_and_its_verdict_only_logged(caplog, monkeypatch, verdict):
    """Issue 32.3: with the option on, train start makes the check's costly first call (its plan,
    probes and graph recording), so no eval pays it; those are real checks of the weights, but no loop
    promises current weights there, so even under strict a bad verdict is a WARNING, not a raise
    (a NOT CHECKED type is named once by the unreadable-type warning). Option off: no call."""
    import mbridge_mxfp8_plugin.adapters.session as adapter
    import mbridge_mxfp8_plugin.verify as verify
    from mbridge_mxfp8_plugin.verify import ParamMismatch, WeightReport

    calls: list[str] = []

    def fake_verify(chunks, optimizer, *, event, sample, accept_unchecked):
        calls.append(event)
        report = WeightReport(event, params_checked=3)
        if verdict == "wrong":
            report.shard_mismatches, report.shard_mismatch_count = [ParamMismatch("w", 1.0, 3)], 1
        if verdict == "not checked":
            report.add_unchecked("w1", "values behind __torch_dispatch__", "OpaqueMXFP8")
        return report

    monkeypatch.setattr(verify, "verify_weights", fake_verify)
    monkeypatch.setattr(adapter, "distributed_optimizers", lambda opt: [opt])
    chunk, optimizer = BucketlessChunk(), object()
    mxfp8_param_sync([chunk], optimizer, enabled=False)
    assert calls == []  # the option off: control
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        sync = mxfp8_param_sync([chunk], optimizer, enabled=False, verify_weights=True, strict=True)
    assert calls == ["train start, warm-up (loop API)"]
    assert sync.session.last_report is None  # not an event's check
    assert sync.session.prepared_s is not None  # what it cost, kept for the adapter's user
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("weight check prepared at train start in" in m for m in infos), infos
    warnings = [r.getMessage() for r in caplog.records if logging.WARNING <= r.levelno < logging.ERROR]
    if verdict == "ok":
        assert warnings == []
    elif verdict == "wrong":
        assert len(warnings) == 1 and "WRONG" in warnings[0] and "logged only" in warnings[0], warnings
    else:
        assert len(warnings) == 1 and "OpaqueMXFP8" in warnings[0], warnings
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
