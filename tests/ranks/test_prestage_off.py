"""Without pre-staging the callback gathers by itself in on_eval_start: one extra all-gather per
bucket group, same (correct) numbers. Guards the fallback used when a forced sync is not predicted."""

from __future__ import annotations

from harness.bridge_loop import LoopSchedule
from harness.scenarios import run_bridge_scenario


def test_plugin_without_prestage_matches_reference(bridge_runs):
    schedule = LoopSchedule(train_iters=10, eval_interval=3, eval_iters=2)
    run = run_bridge_scenario("plugin", schedule, run_test=True, callback_kwargs={"prestage": False})[0]
    ref = bridge_runs["reference"][0]
    assert max(abs(a - b) for a, b in zip(run.train_losses, ref.train_losses, strict=True)) <= 1e-4
    assert max(abs(run.eval_losses[k] - ref.eval_losses[k]) for k in ref.eval_losses) <= 1e-4
    gathers = [s["all_gathers"] for e, s in run.plugin_events if e == "on_eval_start"]
    assert gathers and all(g >= 1 for g in gathers)
