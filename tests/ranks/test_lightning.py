"""The Lightning adapter on a real ``lightning.pytorch.Trainer``, 2 gloo ranks, real megatron-core.

All loop orders (see ``harness.lightning_loop.ORDERS``) x {reference, plugin
off, plugin on} run in ONE 2-rank spawn (about 20 s); the tests assert on the recorded losses.
Without the plugin every order must visibly differ from the reference, so these tests can fail.
The callback's single-process behaviour (discovery, pickling, the optional extra):
tests/unit/test_lightning_callback.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

TOL = 1e-4
ORDER_NAMES = ("nemo", "nemo_save_sanity", "staging_prehooks", "bridge")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL  # False for NaN, which counts as a difference


@pytest.fixture(scope="module")
def lightning_runs():
    from harness.lightning_loop import run_lightning_orders

    return run_lightning_orders(list(ORDER_NAMES), train_steps=9, val_every=3)


def _pair(runs, order: str, plugin: bool):
    return runs[(order, "reference")][0], runs[(order, "plugin" if plugin else "mxfp8")][0]


def test_lightning_runs_complete_and_ranks_agree(lightning_runs):
    for (order, mode), per_rank in lightning_runs.items():
        r0, r1 = per_rank
        assert len(r0.train_losses) == 9, (order, mode)
        assert [s for s, _, _ in r0.val_losses if s] == [3, 6, 9], (order, mode)
        assert str(r0.train_losses) == str(r1.train_losses), (order, mode)  # str: NaN-safe
        assert str(r0.val_losses) == str(r1.val_losses), (order, mode)
    sanity = lightning_runs[("nemo_save_sanity", "reference")][0].val_losses[0]
    assert sanity[:2] == (0, True)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_validation_losses_match_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    assert [(s, c) for s, c, _ in got.val_losses] == [(s, c) for s, c, _ in ref.val_losses]
    pairs = [(s, c, r, g) for (s, c, r), (_, _, g) in zip(ref.val_losses, got.val_losses, strict=True)]
    if plugin:
        assert all(_close(r, g) for *_, r, g in pairs), pairs
    else:
        # nemo*: pre-hooks gather the zeroed buffer (no staging); staging_prehooks: they gather
        # gradients; bridge: the forced sync leaves stale weights (B1) -- plus A everywhere.
        assert not any(_close(r, g) for *_, r, g in pairs), pairs


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_test_after_fit_matches_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    assert ref.test_loss is not None and got.test_loss is not None
    assert _close(ref.test_loss, got.test_loss) == plugin, (ref.test_loss, got.test_loss)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_training_after_each_validation_matches_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    # The step right after each validation (and after the sanity check, before step 0).
    after = sorted({s for s, _, _ in ref.val_losses if s < len(ref.train_losses)})
    pairs = [(i, ref.train_losses[i], got.train_losses[i]) for i in after]
    if plugin:
        assert all(_close(r, g) for _, r, g in pairs), pairs
        assert all(_close(r, g) for r, g in zip(ref.train_losses, got.train_losses, strict=True))
    else:
        assert not any(_close(r, g) for _, r, g in pairs), pairs


def test_nemo_save_forces_sync_before_validation(lightning_runs):
    got = lightning_runs[("nemo_save_sanity", "plugin")][0]
    assert got.saves == [3, 6, 9]
    events = [e.split(":")[0] for e in got.plugin_events]
    # sanity check first, then save -> validation at each of steps 3, 6, 9. NeMo saves the last
    # step (max_steps) weights-only, which fires no on_save_checkpoint: the plugin prepares that
    # save at the step's on_train_batch_end.
    assert events[:2] == ["on_validation_start", "on_validation_end"]
    for k, save in enumerate(["on_save_checkpoint", "on_save_checkpoint", "on_train_batch_end"]):
        i = 2 + 3 * k
        assert events[i : i + 3] == [save, "on_validation_start", "on_validation_end"], events


@pytest.fixture(scope="module")
def verify_runs():
    from harness.lightning_loop import run_lightning_orders

    return run_lightning_orders(["nemo"], modes=("plugin_verify",), train_steps=6, val_every=3)


def test_the_weight_check_is_prepared_at_train_start_and_every_check_after_is_ok(verify_runs):
    """Issue 32.3 on a real Trainer: with verify_weights on, the callback's on_train_start makes
    the check's first call (no eval pays for the plan), and the checks at validation, saves and
    train end that follow are all ok, on every rank. Without the warm-up ``prepared_s`` is None."""
    (runs,) = verify_runs.values()
    for run in runs:
        assert run.verify_prepared_s is not None and run.verify_prepared_s > 0, run
        events = [e for e, _ in run.verify_reports]
        assert any(e.startswith("on_validation") for e in events), events
        assert all(ok for _, ok in run.verify_reports), run.verify_reports
