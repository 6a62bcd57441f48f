"""End to end on real megatron-core, 2 gloo ranks, Bridge's loop order and real CallbackManager.

The same schedule (10 iterations, an eval every 3, a test eval after training) runs three ways;
see ``harness.scenarios``. The reference run never gathers params, so its
losses are what correct MXFP8 training produces. Each defect test is parametrized over the
plugin: off, the defect must be visible; on, it must be gone.
"""

from __future__ import annotations

import pytest
from harness.weights import assert_off_on

TOL = 1e-4


def _run(bridge_runs, plugin: bool):
    return bridge_runs["plugin" if plugin else "mxfp8"][0]


def test_reference_has_evals_and_steps(bridge_runs):
    ref = bridge_runs["reference"][0]
    assert len(ref.train_losses) == 10
    assert sorted(k for k in ref.eval_losses if k >= 0) == [3, 6, 9]
    assert -1 in ref.eval_losses  # the test eval after train()


def test_ranks_agree(bridge_runs):
    for mode, per_rank in bridge_runs.items():
        assert per_rank[0].train_losses == per_rank[1].train_losses, mode
        assert per_rank[0].eval_losses == per_rank[1].eval_losses, mode


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_defect_a_bucket_offsets(bridge_runs, plugin):
    run = _run(bridge_runs, plugin)
    # megatron-core 0.16.1 builds param_to_index without the 64-element padding: the toy model's
    # numels are not multiples of 64, so the mismatch exists before anything runs.
    assert run.offset_mismatches_before > 0
    if plugin:
        assert run.offset_mismatches_after == 0
    else:
        assert run.offset_mismatches_after == run.offset_mismatches_before


# Deliberately the check of test_loop's test_defect_b_eval_weights (duplicates lists the pair):
# the same defect, shown on Bridge's loop order here and on Megatron-LM's there.
@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_eval_losses_match_reference(bridge_runs, plugin):
    ref = bridge_runs["reference"][0].eval_losses
    got = _run(bridge_runs, plugin).eval_losses
    # Off, defect B: eval runs on stale (and, via A, mis-sliced) weights.
    assert_off_on({step: abs(got[step] - ref[step]) for step in ref}, plugin, TOL)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_first_train_step_after_eval(bridge_runs, plugin):
    ref = bridge_runs["reference"][0].train_losses
    got = _run(bridge_runs, plugin).train_losses
    after_eval = [3, 6, 9]  # 0-based index of the step that follows the eval at 3, 6, 9
    diffs = {i: abs(got[i] - ref[i]) for i in after_eval}
    if plugin:
        assert all(d <= TOL for d in diffs.values()), diffs
    else:
        # Defect C: that step skips its gather and runs on the weights the forced sync left.
        assert any(d > 10 * TOL for d in diffs.values()), diffs


def test_all_train_losses_match_with_plugin(bridge_runs):
    ref = bridge_runs["reference"][0].train_losses
    got = bridge_runs["plugin"][0].train_losses
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= TOL


def test_plugin_fired_through_callback_manager_without_extra_gathers(bridge_runs):
    events = bridge_runs["plugin"][0].plugin_events
    names = [e for e, _ in events]
    assert names.count("on_eval_start") == 3 and "on_test_start" in names
    for name, stats in events:
        if name == "on_eval_start":
            # The callback staged main params at on_train_step_end, so Bridge's own forced
            # gather collected weights; the plugin only copied them back.
            assert stats["all_gathers"] == 0, stats
            assert stats["params_written"] > 0, stats
