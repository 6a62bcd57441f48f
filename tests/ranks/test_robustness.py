"""Robustness (issue 7): parallel layouts, forced syncs at odd moments, misuse.

Real megatron-core on CPU + gloo. Every case runs three ways in the same spawned ranks (see
``harness.robust``): ``reference`` (bf16 params, same MXFP8 rounding on the
fly, no param gather), ``mxfp8`` (plugin off) and ``plugin``. Each defect test is parametrized
plugin_off / plugin_on: off must show the defect, on must equal the reference within 1e-4.
All 2-rank cases (and the misuse checks) share one spawn, the 4-rank cases another.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
from harness.bridge_loop import LoopSchedule
from harness.robust import MISUSE, Case, CaseRun, run_cases

from mbridge_mxfp8_plugin.testing.toy import ToyConfig

TOL = 1e-4
SHOWN = 1e-3  # a defect moves a loss by more than this

S = LoopSchedule(train_iters=7, eval_interval=3, eval_iters=1)
DEEP = (32, 45, 45, 45, 10)  # four layers: room for chunks and buckets

CASES_2 = [
    # several DDP chunks per rank (virtual-pipeline layout, PP=1), several buckets each
    Case("chunks2", ToyConfig(dims=DEEP, num_chunks=2, bucket_size=1000), S),
    Case("chunks3_align", ToyConfig(dims=DEEP, num_chunks=3, bucket_size=1000, align_param_gather=True), S),
    # small buckets: many buckets and bucket groups in one chunk
    Case("many_buckets", ToyConfig(dims=DEEP, bucket_size=300), S),
    Case("many_buckets_align", ToyConfig(dims=DEEP, bucket_size=300, align_param_gather=True), S),
    # frozen layer, tied input/output embedding (bf16), params of numel 1/63/64/65, bf16-only buckets
    Case(
        "odd_params",
        ToyConfig(
            dims=(32, 45, 45, 32),
            frozen_layers=(1,),
            tied_vocab=24,
            odd_numels=(1, 63, 64, 65),
            bucket_size=500,
        ),
        S,
    ),
    # MoE: EP=2 on 2 ranks -> expert data-parallel size 1; dense + expert DistributedOptimizers
    Case("moe_ep2_edp1", ToyConfig(dims=DEEP, expert_layers=(1, 2), expert_model_parallel_size=2), S),
    # gather dispatched by the optimizer step (needs >= 2 chunks: core gives chunk 0 its own optimizer)
    Case(
        "optimizer_step_gather",
        ToyConfig(dims=DEEP, num_chunks=2, extra_opt={"overlap_param_gather_with_optimizer_step": True}),
        S,
    ),
    Case("eval_at_iteration_0", schedule=S, flow="eval_first"),
    Case("eval_only", schedule=S, flow="eval_only"),
    Case("evals_back_to_back", schedule=replace(S, train_iters=6), flow="back_to_back"),
    Case("eval_raises", schedule=replace(S, train_iters=9), flow="eval_error", flow_arg=2),
    Case("resume", schedule=replace(S, train_iters=9), flow="resume", flow_arg=4),
    Case("callback_twice", schedule=replace(S, save_interval=4), callbacks="same_twice"),
    Case("two_callbacks", schedule=replace(S, save_interval=4), callbacks="two_instances"),
]

# megatron-core 0.16.1 builds the hierarchical groups of several distributed-optimizer instances
# with einops (parallel_state.create_hierarchical_groups), which its base install does not pull in.
HAVE_EINOPS = importlib.util.find_spec("einops") is not None
CASES_4 = [
    # EP=2 on 4 ranks: expert data-parallel size 2
    Case("moe_ep2_edp2", ToyConfig(dims=DEEP, expert_layers=(1, 2), expert_model_parallel_size=2), S),
] + (
    # two distributed-optimizer instances of 2 ranks each
    [Case("dist_opt_instances2", ToyConfig(dims=DEEP, bucket_size=1000), S, dist_opt_instances=2)]
    if HAVE_EINOPS
    else []
)


@pytest.fixture(scope="module")
def runs2() -> list[dict[str, dict[str, CaseRun]]]:
    return run_cases(CASES_2, 2, misuse=True)


@pytest.fixture(scope="module")
def runs4() -> list[dict[str, dict[str, CaseRun]]]:
    return run_cases(CASES_4, 4)


def _runs(request: Any, name: str) -> list[dict[str, CaseRun]]:
    per_rank = request.getfixturevalue("runs4" if name in {c.name for c in CASES_4} else "runs2")
    return [r[name] for r in per_rank]


def _diffs(got: CaseRun, ref: CaseRun) -> tuple[dict[int, float], dict[int, float]]:
    assert len(got.train_losses) == len(ref.train_losses), (got.train_losses, ref.train_losses)
    assert sorted(got.eval_losses) == sorted(ref.eval_losses), (got.eval_losses, ref.eval_losses)
    train = {i: abs(a - b) for i, (a, b) in enumerate(zip(got.train_losses, ref.train_losses, strict=True))}
    evals = {k: abs(got.eval_losses[k] - ref.eval_losses[k]) for k in ref.eval_losses}
    return train, evals


def _defect_shown(case: Case, train: dict[int, float], evals: dict[int, float]) -> bool:
    """What plugin_off must show for this case."""
    if case.flow == "eval_first":
        return evals[0] > SHOWN  # the eval before any step reads gathered zeros
    if case.flow == "eval_only":
        return evals[0] > SHOWN and evals[-1] > SHOWN
    if case.flow == "back_to_back":
        return all(evals[k] > SHOWN for k in (-1, -2, -3))  # stale weights after train()
    if case.flow == "eval_error":
        return train[case.flow_arg * case.schedule.eval_interval] > SHOWN  # first step after recovery
    if case.flow == "resume":
        return train[case.flow_arg] > SHOWN  # first step on the stale checkpoint
    # train flow: stale eval weights (B) and a polluted step after each eval (C)
    after_eval = [s for s in evals if s > 0 and s < len(train)]
    return all(evals[s] > SHOWN for s in evals if s > 0) and any(train[s] > SHOWN for s in after_eval)


REFUSED = {"optimizer_step_gather"}
MATCHING = [c for c in CASES_2 + CASES_4 if c.name not in REFUSED]


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("case", MATCHING, ids=[c.name for c in MATCHING])
def test_case_matches_reference(request, case, plugin):
    runs = _runs(request, case.name)[0]
    ref, got = runs["reference"], runs["plugin" if plugin else "mxfp8"]
    assert ref.error is None, ref.traceback
    assert got.error is None, got.traceback
    train, evals = _diffs(got, ref)
    if plugin:
        assert max(train.values(), default=0.0) <= TOL, train
        assert max(evals.values(), default=0.0) <= TOL, evals
    else:
        assert _defect_shown(case, train, evals), (train, evals)


@pytest.mark.parametrize("case", MATCHING, ids=[c.name for c in MATCHING])
def test_ranks_agree(request, case):
    per_rank = _runs(request, case.name)
    for mode in case.modes:
        assert {tuple(r[mode].train_losses) for r in per_rank} == {tuple(per_rank[0][mode].train_losses)}, (
            mode
        )
        assert all(r[mode].eval_losses == per_rank[0][mode].eval_losses for r in per_rank), mode


def _params_written(run: CaseRun, event: str = "on_eval_start") -> list[int]:
    return [s["params_written"] for e, s in run.plugin_events if e == event and s["params_written"]]


@pytest.mark.parametrize("name", ["chunks2", "chunks3_align", "many_buckets", "many_buckets_align"])
def test_every_chunk_and_bucket_written_back(request, name):
    run = _runs(request, name)[0]["plugin"]
    chunks = run.info["chunks"]
    trainable = sum(c["trainable"] for c in chunks)
    if name.startswith("chunks"):
        assert len(chunks) == int(name[6]) and all(c["buckets"] >= 1 for c in chunks), chunks
        assert sum(c["buckets"] for c in chunks) > len(chunks), chunks
    else:
        assert chunks[0]["buckets"] >= 3 and chunks[0]["bucket_groups"] >= 3, chunks
    if name.endswith("align"):
        assert run.info["chunks"][0]["bucket_groups"] >= 2
    # Every eval wrote back every param of every chunk: none skipped.
    written = _params_written(run)
    assert len(written) == 2 and all(w == trainable for w in written), (written, trainable)


def test_odd_params_layout(request):
    run = _runs(request, "odd_params")[0]["plugin"]
    chunk = run.info["chunks"][0]
    assert {1, 63, 64, 65} <= set(chunk["numels"]), chunk["numels"]
    assert chunk["trainable"] < chunk["params"]  # the frozen layer is not in any bucket
    kinds = chunk["bucket_kinds"]
    assert any(mx == 0 and plain > 0 for mx, plain in kinds), kinds  # a bf16-only bucket ...
    assert any(mx > 0 for mx, _ in kinds), kinds  # ... next to MXFP8 buckets
    assert _params_written(run) and all(w == chunk["trainable"] for w in _params_written(run))


@pytest.mark.parametrize("name,expert_dp", [("moe_ep2_edp1", 1), ("moe_ep2_edp2", 2)])
def test_moe_expert_buffers(request, name, expert_dp):
    run = _runs(request, name)[0]["plugin"]
    info = run.info
    assert info["expert_dp_size"] == expert_dp
    assert info["optimizer"] == "ChainedOptimizer" and info["distributed_optimizers"] == 2
    chunk = info["chunks"][0]
    assert chunk["expert_buckets"] >= 1 and chunk["expert_bucket_groups"] >= 1
    assert all(w == chunk["trainable"] for w in _params_written(run)), _params_written(run)


@pytest.mark.skipif(
    not HAVE_EINOPS, reason="num_distributed_optimizer_instances>1 needs einops in core 0.16.1"
)
def test_dist_opt_instances(request):
    info = _runs(request, "dist_opt_instances2")[0]["plugin"].info
    assert info["dp_size"] == 4 and info["intra_dist_opt_size"] == 2


def test_optimizer_step_gather_core_cannot_train_and_plugin_refuses(request):
    runs = _runs(request, "optimizer_step_gather")[0]
    ref, off, on = runs["reference"], runs["mxfp8"], runs["plugin"]
    assert ref.error is None and off.error is None, (ref.traceback, off.traceback)
    assert ref.info["distributed_optimizers"] == 2  # chunk 0 has its own optimizer for the step gather
    # Without reuse (the reference) core trains fine in this mode; with reuse the gather dispatched
    # by the optimizer step collects the grad buffer before the main params are staged.
    train, _ = _diffs(off, ref)
    assert max(train.values()) > SHOWN, train
    # The plugin refuses at train start, before any step, with one error naming rule and fix.
    # ConfigValidationError is the validator's MXFP8ConfigError (a ValueError)
    assert on.error is not None and on.error.startswith("ConfigValidationError: "), on.error
    assert "MX007" in on.error and "overlap_param_gather_with_optimizer_step" in on.error, on.error
    assert on.train_losses == []


def test_callbacks_registered_twice_share_one_engine(request):
    for name in ("callback_twice", "two_callbacks"):
        run = _runs(request, name)[0]["plugin"]
        evals = [s for e, s in run.plugin_events if e == "on_eval_start"]
        # One write-back per eval in total, whichever callback fired first; no extra gathers.
        assert sum(s["params_written"] > 0 for s in evals) == 2, evals
        assert all(s["all_gathers"] == 0 for s in evals), evals


# ------------------------------------------------------------------------------------- misuse
@pytest.fixture(scope="module")
def misuse(runs2) -> dict[str, str]:
    return runs2[0][MISUSE]["checks"].info


def test_non_megatron_models_are_a_logged_no_op(misuse):
    for key in ("plain_module", "torch_ddp"):
        assert misuse[key].startswith("ok: engine=None"), misuse[key]
        assert "not megatron-core DistributedDataParallel" in misuse[key], misuse[key]


def test_non_distributed_optimizer_refused_at_train_start(misuse):
    msg = misuse["torch_optimizer"]
    assert msg.startswith("MXFP8UsageError: "), msg
    assert "Adam" in msg and "DistributedOptimizer" in msg and "use_distributed_optimizer=True" in msg, msg


def test_engine_misuse_errors(misuse):
    assert misuse["engine_plain_module"].startswith("MXFP8UsageError: "), misuse["engine_plain_module"]
    assert "not megatron-core DistributedDataParallel" in misuse["engine_plain_module"]
    msg = misuse["engine_without_optimizer_stage"]
    assert msg.startswith("MXFP8UsageError: ") and "optimizer=" in msg, msg


def test_in_flight_gather_is_never_reset_or_redispatched(misuse):
    assert misuse["in_flight_dispatched"] == "handle=True dispatched=True"
    # step_started / stage_main_params / before_eval (no optimizer) leave a gather in flight alone
    assert misuse["in_flight_restore"] == "groups_reset=0 handle_kept=True dispatched=True"
    assert misuse["in_flight_stage"] == "staged=False"
    assert misuse["in_flight_hold"] == "handle_kept=True"
    assert float(misuse["in_flight_weights_before_refresh"]) > 1e-3  # the "step" is not visible yet
    # a refresh waits for it, then stages, gathers and writes back every group once
    assert misuse["in_flight_refresh"].endswith("handle=None dispatched=True"), misuse["in_flight_refresh"]
    assert float(misuse["in_flight_weights_after_refresh"]) == 0.0
