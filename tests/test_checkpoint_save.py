"""Checkpoint saves: a forced param sync that fires no callback (Bridge's save_checkpoint_and_time).

The weights a save captures (``param.data``, what dist-checkpointing writes) must be the current
main params rounded to the param format: bf16 for biases, MXFP8 for the weights. Without the
plugin, core 0.16 captures the weights of the previous iteration.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.testing import mxfp8_quantize
from mbridge_mxfp8_plugin.testing.bridge_loop import LoopSchedule
from mbridge_mxfp8_plugin.testing.scenarios import run_bridge_scenario

SCHEDULE = LoopSchedule(train_iters=9, eval_interval=3, eval_iters=1, save_interval=4)


@pytest.fixture(scope="module")
def save_runs():
    return {
        mode: run_bridge_scenario(mode, SCHEDULE, keep_weights=True)[0]
        for mode in ("reference", "mxfp8", "plugin")
    }


def _expected(ref_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The reference keeps bf16 params; an MXFP8 param holds the same values rounded to MXFP8.
    return {k: (mxfp8_quantize(v) if k.endswith("weight") else v) for k, v in ref_weights.items()}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_saved_weights_are_the_current_weights(save_runs, plugin):
    ref = save_runs["reference"]
    run = save_runs["plugin" if plugin else "mxfp8"]
    assert sorted(ref.saved_weights) == sorted(run.saved_weights) and ref.saved_weights
    worst = {step: _worst(run.saved_weights[step], _expected(w)) for step, w in ref.saved_weights.items()}
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
    assert _worst(run.final_weights, _expected(ref.final_weights)) == 0.0
