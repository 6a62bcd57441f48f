"""The loop-agnostic API (``mxfp8_param_sync``) in a loop written in Megatron-LM's own order.

Megatron-LM's ``megatron/training/training.py`` has no callbacks; :func:`_train` below follows its
``train()`` and ``train_step()`` at tag ``core_v0.16.1`` step by step (line numbers of that file in
the comments) around the toy model, on real megatron-core over 2 gloo ranks, with the API's calls
where the README tells a Megatron-LM user to add them. The schedule trains, evaluates, saves and
trains on (7 iterations, evals at 3 and 6, saves at 2, 4 and 6, the closing forced sync).

Three runs: ``reference`` (bf16 params with the same MXFP8 rounding on the fly, no param gather:
what correct training produces), ``off`` (MXFP8 params, fp8 param gather with grad-buffer reuse,
no plugin) and ``on`` (the same with the API). Each defect test is parametrized off/on: off must
show the defect the installed megatron-core has, on must match the reference.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from harness.weights import RunRecord, assert_off_on, expected_mxfp8_weights, weights_of, worst_diff

# The Megatron-LM-order train step and evaluate (core_v0.16.1 training.py line refs there) are the
# public kit's, which the demo uses too: one copy of that order, exercised here with saves.
from mbridge_mxfp8_plugin.testing.megatron_lm_loop import evaluate as _evaluate
from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step as _train_step

TOL = 1e-4
TRAIN_ITERS, EVAL_INTERVAL, SAVE_INTERVAL = 7, 3, 2
#: 0-based steps that follow a forced sync: saves at 2, 4, 6, evals at 3, 6 (eval before save)
AFTER_SYNC = (2, 3, 4, 6)


@dataclass
class LoopRecord(RunRecord):
    #: per iteration: bucket groups a forced sync left "dispatched" with no gather in flight when
    #: the step's forwards begin, i.e. groups whose gather, copy-back and re-zeroing the step skips
    skipped_gathers: list[int] = field(default_factory=list)
    offset_mismatches_before: int = 0
    offset_mismatches_after: int = 0
    core: dict[str, Any] = field(default_factory=dict)
    same_session: bool = False
    stats: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _train(job: Any, plugin: bool) -> LoopRecord:
    """``train()`` of Megatron-LM core_v0.16.1 training.py (L2417-3012), with the API's lines."""
    from mbridge_mxfp8_plugin.adapters.loop import mxfp8_param_sync
    from mbridge_mxfp8_plugin.testing.toy import make_batches

    model, optimizer = job.model, job.optimizer
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rec = LoopRecord()
    eval_batches = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
    # should_disable_forward_pre_hook (L3496-3498): not FSDP, distributed optimizer, overlap.
    toggle = job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather
    pre_hook_enabled = False
    if toggle:  # L2657-2663: the first iteration runs without pre-hooks
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=False)
    sync = mxfp8_param_sync(model, optimizer) if plugin else None  # API: before the loop
    iteration = start_iteration = 0
    while iteration < TRAIN_ITERS:  # L2684
        if sync is not None:
            rec.stats.append(("step_started", vars(sync.step_started())))  # API: after L2785
        ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=iteration)
        rec.train_losses.append(_train_step(job, x, y, rec.skipped_gathers))  # L2786-2797
        if iteration == start_iteration and toggle:  # L2815-2829: pre-hooks on after the first step
            for chunk in model:
                chunk.enable_forward_pre_hook()
            pre_hook_enabled = True
        iteration += 1  # L2839
        if iteration % EVAL_INTERVAL == 0:  # L2914: evaluation
            if toggle:  # L2918-2920: forced all-gather
                for chunk in model:
                    chunk.disable_forward_pre_hook()
                pre_hook_enabled = False
            if sync is not None:
                rec.stats.append(("before_eval", vars(sync.before_eval())))  # API: before L2945
            rec.eval_losses[iteration] = _evaluate(job, eval_batches)  # L2945-2949
            if toggle:  # L2959-2961
                for chunk in model:
                    chunk.enable_forward_pre_hook()
                pre_hook_enabled = True
            if sync is not None:
                rec.stats.append(("after_eval", vars(sync.after_eval())))  # API: after L2961
        if iteration % SAVE_INTERVAL == 0:  # checkpoint_and_decide_exit (L2982) -> L2340-2350 regular save
            # save_checkpoint_and_time (L2168-2193): no hook before the forced sync in any release.
            if sync is not None:
                same = mxfp8_param_sync(model, optimizer)  # API: in save_checkpoint_and_time
                rec.same_session = same is sync
                rec.stats.append(("before_save", vars(same.before_save())))
            if toggle:  # L2192-2193: force_param_sync(model), pre-hooks stay on
                for chunk in model:
                    chunk.start_param_sync(force_sync=True)
            rec.saved_weights[iteration] = weights_of(model)  # what the checkpoint writes: param.data
    if pre_hook_enabled:  # L3006-3007: the closing forced sync
        for chunk in model:
            chunk.disable_forward_pre_hook()
    if sync is not None:
        rec.stats.append(("close", vars(sync.close())))  # API: after L3007
    rec.final_weights = weights_of(model)
    return rec


def _rank_body(mode: str) -> LoopRecord:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin import check_bucket_alignment
    from mbridge_mxfp8_plugin.probes import probe_bucket_offsets, probe_core
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    with cpu_shim(), emulated_mxfp8():
        job = build_job(replace(ToyConfig(), reference=(mode == "reference")))
        before = 0
        if mode != "reference":
            before = len(check_bucket_alignment(job.model, repair=False).mismatches)
        rec = _train(job, plugin=(mode == "on"))
        rec.offset_mismatches_before = before
        if mode != "reference":
            rec.offset_mismatches_after = len(check_bucket_alignment(job.model, repair=False).mismatches)
        rec.core = {**probe_core().as_dict(), "pads_bucket_offsets": probe_bucket_offsets()}
        return rec


@pytest.fixture(scope="module")
def runs() -> dict[str, list[LoopRecord]]:
    from mbridge_mxfp8_plugin.testing import launch

    return {mode: launch(_rank_body, 2, mode) for mode in ("reference", "off", "on")}


def _run(runs: dict[str, list[LoopRecord]], plugin: bool) -> LoopRecord:
    return runs["on" if plugin else "off"][0]


def _core(runs: dict[str, list[LoopRecord]]) -> dict[str, Any]:
    return runs["off"][0].core


def test_schedule_and_ranks(runs):
    ref = runs["reference"][0]
    assert len(ref.train_losses) == TRAIN_ITERS
    assert sorted(ref.eval_losses) == [3, 6] and sorted(ref.saved_weights) == [2, 4, 6]
    for mode, per_rank in runs.items():
        # NaN-safe: without the plugin, core >= 0.18 evaluates gathered gradients read as bf16.
        for a, b in (
            (per_rank[0].train_losses, per_rank[1].train_losses),
            (list(per_rank[0].eval_losses.values()), list(per_rank[1].eval_losses.values())),
        ):
            assert len(a) == len(b) and all(
                x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
            ), mode


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_defect_a_bucket_offsets(runs, plugin):
    run = _run(runs, plugin)
    if _core(runs)["pads_bucket_offsets"]:
        pytest.skip("this megatron-core pads bucket offsets itself (defect A fixed upstream)")
    # The toy's numels are not multiples of 64: core <= 0.16 mis-indexes the padded buffer.
    assert run.offset_mismatches_before > 0
    assert run.offset_mismatches_after == (0 if plugin else run.offset_mismatches_before)
    # Its effect: the first step that gathers (step 0 runs without pre-hooks), before any eval
    # or save, already runs on params that received their neighbours' bytes.
    assert_off_on({1: abs(run.train_losses[1] - runs["reference"][0].train_losses[1])}, plugin, TOL)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_defect_b_eval_weights(runs, plugin):
    ref = runs["reference"][0].eval_losses
    got = _run(runs, plugin).eval_losses
    # Off: the eval's forced gather is not written back (core < 0.18) or collects gradients
    # (core >= 0.18 with this loop order; NaN when they are read as bf16 weights): eval reads
    # stale or garbage weights.
    assert_off_on({it: abs(got[it] - ref[it]) for it in ref}, plugin, TOL)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_defect_c_step_after_forced_sync(runs, plugin):
    run = _run(runs, plugin)
    after_sync = AFTER_SYNC
    skipped = {i: run.skipped_gathers[i] for i in after_sync}
    others = [n for i, n in enumerate(run.skipped_gathers) if i not in after_sync]
    assert not any(others), run.skipped_gathers
    if plugin:
        assert not any(skipped.values()), skipped
    elif _core(runs)["has_dispatch_reset"]:
        pytest.skip("megatron-core >= 0.19 resets the dispatch state itself (defect C fixed upstream)")
    else:
        # param_gather_dispatched survived the forced sync: these steps skip gather + copy-back.
        assert all(n > 0 for n in skipped.values()), skipped
    ref = runs["reference"][0].train_losses
    assert_off_on({i: abs(run.train_losses[i] - ref[i]) for i in after_sync}, plugin, TOL)


def test_every_step_matches_reference_with_plugin(runs):
    ref = runs["reference"][0].train_losses
    got = runs["on"][0].train_losses
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= TOL


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_saved_and_final_weights(runs, plugin):
    ref = runs["reference"][0]
    run = _run(runs, plugin)
    wanted = {it: expected_mxfp8_weights(w) for it, w in ref.saved_weights.items()}
    wanted[-1] = expected_mxfp8_weights(ref.final_weights)
    got = {**run.saved_weights, -1: run.final_weights}
    diffs = {it: worst_diff(got[it], wanted[it]) for it in wanted}
    if not plugin and _core(runs)["has_dispatch_reset"]:
        # Core 0.19 with this (0.16.1-order) loop: saves right after a step gather gradients and
        # write them back (garbage, checked); the closing sync follows a step that staged.
        del diffs[-1]
    # Off: the saves and the closing sync leave the previous iteration's (or gathered-gradient)
    # weights in the params.
    assert_off_on(diffs, plugin, TOL)


def test_api_shares_one_session_and_gathers_only_where_needed(runs):
    run = runs["on"][0]
    assert run.same_session
    by_call: dict[str, list[dict[str, Any]]] = {}
    for name, stats in run.stats:
        by_call.setdefault(name, []).append(stats)
    assert len(by_call["before_eval"]) == 2 and len(by_call["before_save"]) == 3
    assert not any(s["all_gathers"] for s in by_call["step_started"] + by_call["after_eval"])
    saves = dict(zip((2, 4, 6), by_call["before_save"], strict=True))
    if not _core(runs)["forced_sync_writes_back"]:
        # Core < 0.18 writes no forced gather back: a save without an eval before it costs one
        # gather per bucket group; after an eval the weights are still current (no step since).
        assert saves[2]["all_gathers"] > 0 and saves[4]["all_gathers"] > 0, saves
        assert saves[6]["all_gathers"] == 0 and saves[6]["note"] == "weights already fresh", saves
        # The eval's write-back leaves the gathered weights in the buffer (the next step's
        # zero_grad_buffer clears it before any gradient lands there).
        assert all(s["buckets_zeroed"] == 0 for s in by_call["before_eval"]), by_call["before_eval"]
    else:
        # Core >= 0.18 writes the save's own forced gather back: staging is enough.
        assert all(s["all_gathers"] == 0 and s["staged"] for s in saves.values()), saves
