"""Checkpoint saves: a forced param sync that fires no callback (Bridge's save_checkpoint_and_time).

The weights a save captures (``param.data``, what dist-checkpointing writes) must be the current
main params rounded to the param format: bf16 for biases, MXFP8 for the weights. Without the
plugin, core 0.16 captures the weights of the previous iteration.
"""

from __future__ import annotations

import pytest
from harness.bridge_loop import LoopSchedule
from harness.scenarios import run_bridge_scenario
from harness.weights import expected_mxfp8_weights, worst_diff

SCHEDULE = LoopSchedule(train_iters=9, eval_interval=3, eval_iters=1, save_interval=4)


@pytest.fixture(scope="module")
def save_runs():
    return {
        mode: run_bridge_scenario(mode, SCHEDULE, keep_weights=True)[0]
        for mode in ("reference", "mxfp8", "plugin")
    }


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_saved_weights_are_the_current_weights(save_runs, plugin):
    ref = save_runs["reference"]
    run = save_runs["plugin" if plugin else "mxfp8"]
    assert sorted(ref.saved_weights) == sorted(run.saved_weights) and ref.saved_weights
    worst = {
        step: worst_diff(run.saved_weights[step], expected_mxfp8_weights(w))
        for step, w in ref.saved_weights.items()
    }
    if plugin:
        assert all(v == 0.0 for v in worst.values()), worst
    else:
        assert all(v > 1e-3 for v in worst.values()), worst


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_step_after_save_matches_reference(save_runs, plugin):
    ref, run = save_runs["reference"], save_runs["plugin" if plugin else "mxfp8"]
    after_save = [s for s in ref.saved_weights if s < len(ref.train_losses)]
    diffs = [abs(run.train_losses[s] - ref.train_losses[s]) for s in after_save]
    if plugin:
        assert max(diffs) <= 1e-4
        assert max(abs(a - b) for a, b in zip(run.train_losses, ref.train_losses, strict=True)) <= 1e-4
    else:
        assert max(diffs) > 1e-3


def test_final_weights_after_train_are_current(save_runs):
    ref, run = save_runs["reference"], save_runs["plugin"]
    assert worst_diff(run.final_weights, expected_mxfp8_weights(ref.final_weights)) == 0.0
