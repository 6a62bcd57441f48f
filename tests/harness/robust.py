"""Robustness harness: many layouts, forced syncs and misuses in one spawned multi-rank run.

A spawn costs a process start and a megatron-core import per rank (~6-10 s on two cores), so
:func:`run_cases` runs a list of :class:`Case` s one after the other inside *one* spawn, each in
three modes (``reference``, ``mxfp8`` = plugin off, ``plugin``), rebuilding megatron-core's parallel
state only when a case needs a different one (expert parallelism, distributed-optimizer
instances). Every case drives the Bridge loop replica (:mod:`.bridge_loop`) with Bridge's real
``CallbackManager``; the flows below only add what a user or a framework does *around* ``train()``:

``train``
    ``bridge_loop.train`` once.
``eval_first``
    an eval before any step (``evaluate_only`` on the fresh job, callbacks see no optimizer),
    then ``train``. The eval loss is ``eval_losses[0]``.
``eval_only``
    ``evaluate_only(..., run_test=True)``: Bridge's ``skip_train`` path.
``back_to_back``
    ``train(..., run_test=True)`` with the last eval on the last step (eval, then test, no step
    between), then ``evaluate_only(..., run_test=True)`` on the trained model: four evals in a
    row. The extra ones are ``eval_losses[-2]`` (validation) and ``[-3]`` (test).
``eval_error``
    the ``flow_arg``-th eval raises inside its loop (first eval batch). The caller catches it and
    puts the chunks back the way Bridge's ``evaluate`` would have left them (``model.train()``,
    forward pre-hooks re-enabled: without that megatron-core's next ``disable_forward_pre_hook``
    fails on the missing hook handles), then calls ``train`` again from the same step. The
    interrupted eval has no loss; everything else must equal an uninterrupted reference run.
``resume``
    train to step ``flow_arg`` with a save there (the checkpoint is what the save captured:
    ``param.data`` of every param, i.e. what dist-checkpointing writes for the model), keep the
    distributed optimizers' fp32 main-param shards and Adam moments in memory (what the
    optimizer's sharded state holds), build a fresh job, load both into it and continue with
    ``train`` from that step. Bridge's resumed loop runs its first iteration with the forward
    pre-hooks off, i.e. on the loaded ``param.data``, so a stale checkpoint shows up in that loss.

Model chunks (``ToyConfig.num_chunks``): the layers are split over several DDP chunks per rank,
chunk ``i`` calling chunk ``i + 1`` at the end of its forward. That is the virtual-pipeline layout
(several DDP chunks, each with its own buffers and bucket groups, forwarded in order) with
pipeline size 1; a real PP=2 run needs megatron-core's interleaved schedule with p2p and a
pipeline-aware model, which the Bridge loop replica (no-pipelining schedule) does not drive.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.launcher import launch
from mbridge_mxfp8_plugin.testing.toy import Job, ToyConfig

from .bridge_loop import LoopSchedule
from .weights import RunRecord

__all__ = [
    "Case",
    "CaseRun",
    "FLOWS",
    "InjectedEvalError",
    "layout_info",
    "max_weight_error",
    "MISUSE",
    "run_cases",
]

FLOWS = ("train", "eval_first", "eval_only", "back_to_back", "eval_error", "resume")
CALLBACKS = ("one", "same_twice", "two_instances")


@dataclass(frozen=True)
class Case:
    """One scenario, run in every mode of ``modes`` on the same ranks."""

    name: str
    toy: ToyConfig = field(default_factory=ToyConfig)
    schedule: LoopSchedule = field(default_factory=LoopSchedule)
    flow: str = "train"
    #: eval_error: which eval (1-based) raises; resume: the step saved and resumed from
    flow_arg: int = 0
    #: "one" callback, the "same_twice" instance registered twice, or "two_instances"
    callbacks: str = "one"
    #: ``num_distributed_optimizer_instances`` (parallel state and DDP config)
    dist_opt_instances: int = 1
    run_test: bool = False
    loop: str | None = None
    modes: tuple[str, ...] = ("reference", "mxfp8", "plugin")
    keep_weights: bool = False
    #: keyword arguments for ``MXFP8ParamSyncCallback`` (pairs, so the case stays hashable)
    callback_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.flow not in FLOWS:
            raise ValueError(f"flow must be one of {FLOWS}, got {self.flow!r}")
        if self.callbacks not in CALLBACKS:
            raise ValueError(f"callbacks must be one of {CALLBACKS}, got {self.callbacks!r}")


@dataclass
class CaseRun(RunRecord):
    """What one mode of one case produced on one rank."""

    plugin_events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: layout facts: chunks, buckets and bucket groups per chunk, optimizers, group sizes
    info: dict[str, Any] = field(default_factory=dict)
    #: ``"ExceptionType: message"`` when the run raised (the run stops there)
    error: str | None = None
    traceback: str = ""
    seconds: float = 0.0


class InjectedEvalError(RuntimeError):
    """Raised by the ``eval_error`` flow inside the eval loop."""


# ----------------------------------------------------------------------------------- set-up
_current_layout: tuple[int, int] | None = None


def _ensure_parallel_state(ep: int, instances: int) -> None:
    global _current_layout
    from megatron.core import parallel_state

    if _current_layout == (ep, instances) and parallel_state.model_parallel_is_initialized():
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        1, 1, expert_model_parallel_size=ep, num_distributed_optimizer_instances=instances
    )
    _current_layout = (ep, instances)


def _toy_for(case: Case, mode: str) -> ToyConfig:
    toy = replace(case.toy, reference=(mode == "reference"))
    if case.dist_opt_instances > 1:
        toy = replace(
            toy, extra_ddp={**toy.extra_ddp, "num_distributed_optimizer_instances": case.dist_opt_instances}
        )
    return toy


def _build(case: Case, mode: str) -> Job:
    from mbridge_mxfp8_plugin.testing.toy import build_job

    _ensure_parallel_state(case.toy.expert_model_parallel_size, case.dist_opt_instances)
    return build_job(_toy_for(case, mode))


def layout_info(job: Job) -> dict[str, Any]:
    """Chunks, buckets and bucket groups (dense and expert), optimizers and group sizes."""
    from megatron.core import fp8_utils, parallel_state

    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    chunks = []
    for chunk in job.model:
        ep_groups = list(getattr(chunk, "expert_parallel_bucket_groups", []))
        buffers = list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))
        chunks.append(
            {
                #: (MXFP8 params, plain params) per bucket, over dense then expert buffers
                "bucket_kinds": [
                    (
                        sum(1 for p in b.params_list if fp8_utils.is_mxfp8tensor(p)),
                        sum(1 for p in b.params_list if not fp8_utils.is_mxfp8tensor(p)),
                    )
                    for buf in buffers
                    for b in buf.buckets
                ],
                "numels": sorted(p.numel() for p in chunk.parameters() if p.requires_grad),
                "buckets": sum(len(b.buckets) for b in chunk.buffers),
                "bucket_groups": len(chunk.bucket_groups),
                "expert_buckets": sum(len(b.buckets) for b in getattr(chunk, "expert_parallel_buffers", [])),
                "expert_bucket_groups": len(ep_groups),
                "max_buckets_per_group": max(len(g.buckets) for g in list(chunk.bucket_groups) + ep_groups),
                "params": sum(1 for _ in chunk.parameters()),
                "trainable": sum(1 for p in chunk.parameters() if p.requires_grad),
            }
        )
    opts = distributed_optimizers(job.optimizer)
    return {
        "chunks": chunks,
        "optimizer": type(job.optimizer).__name__,
        "distributed_optimizers": len(opts),
        "expert_dp_size": parallel_state.get_expert_data_parallel_world_size(),
        "intra_dist_opt_size": parallel_state.get_data_parallel_world_size(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "dp_size": parallel_state.get_data_parallel_world_size(),
    }


def _callbacks(case: Case, mode: str, make: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    """(the list handed to the loop, the distinct plugin instances)."""
    if mode != "plugin":
        return [], []
    first = make()
    if case.callbacks == "same_twice":
        return [first, first], [first]
    if case.callbacks == "two_instances":
        second = make()
        return [first, second], [first, second]
    return [first], [first]


@contextmanager
def _start_at(step: int) -> Iterator[None]:
    """Make ``bridge_loop.train`` start at ``step`` (a resumed run's ``train_state.step``)."""
    from . import bridge_loop

    original = bridge_loop._make_state

    def make_state(*args: Any, **kwargs: Any) -> Any:
        state = original(*args, **kwargs)
        state.train_state.step = step
        return state

    bridge_loop._make_state = make_state  # type: ignore[assignment]
    try:
        yield
    finally:
        bridge_loop._make_state = original  # type: ignore[assignment]


def _raise_in_eval(job: Job, nth_eval: int, eval_iters: int) -> None:
    """Chunk 0's forward raises at the first batch of the ``nth_eval``-th eval, once."""
    module = job.model[0].module
    original = module.forward
    seen = {"eval_batches": 0, "fired": False}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not module.training and not seen["fired"]:
            if seen["eval_batches"] == (nth_eval - 1) * eval_iters:
                seen["fired"] = True
                raise InjectedEvalError(f"injected failure in eval #{nth_eval}")
            seen["eval_batches"] += 1
        return original(*args, **kwargs)

    module.forward = forward


def _recover_after_eval_error(job: Job) -> None:
    """What a caller that catches an eval error must do before training again: the state
    Bridge's ``evaluate`` / ``train`` would have restored (``model.train()``, pre-hooks back on)."""
    for chunk in job.model:
        chunk.train()
        if chunk.use_forward_hook and not chunk.remove_forward_pre_hook_handles:
            chunk.enable_forward_pre_hook()


def _optimizer_state(job: Job) -> list[dict[str, Any]]:
    """Each DistributedOptimizer's fp32 main-param shards and torch optimizer state, cloned."""
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    out = []
    for opt in distributed_optimizers(job.optimizer):
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        out.append(
            {
                "main": [p.detach().clone() for p in params],
                "state": [
                    {
                        k: (v.clone() if torch.is_tensor(v) else v)
                        for k, v in opt.optimizer.state.get(p, {}).items()
                    }
                    for p in params
                ],
            }
        )
    return out


def _load_checkpoint(job: Job, weights: dict[str, torch.Tensor], opt_state: list[dict[str, Any]]) -> None:
    """Load a saved ``param.data`` snapshot and the optimizer shards into a fresh job."""
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    with torch.no_grad():
        named = {f"{i}.{n}": p for i, chunk in enumerate(job.model) for n, p in chunk.named_parameters()}
        missing = set(named) ^ set(weights)
        if missing:
            raise KeyError(f"checkpoint and model disagree on {sorted(missing)}")
        for name, p in named.items():
            p.data.copy_(weights[name].to(p.dtype))  # an MXFP8 param quantizes (idempotent here)
        opts = distributed_optimizers(job.optimizer)
        if len(opts) != len(opt_state):
            raise ValueError(f"{len(opts)} distributed optimizers, checkpoint has {len(opt_state)}")
        for opt, saved in zip(opts, opt_state, strict=True):
            params = [p for g in opt.optimizer.param_groups for p in g["params"]]
            for p, main, state in zip(params, saved["main"], saved["state"], strict=True):
                p.copy_(main)
                if state:
                    opt.optimizer.state[p] = {
                        k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()
                    }


# ----------------------------------------------------------------------------------- flows
def _run_mode(case: Case, mode: str) -> CaseRun:
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback

    from .bridge_loop import evaluate_only, train

    def make() -> Any:
        return MXFP8ParamSyncCallback(**dict(case.callback_options))

    out = CaseRun()
    sched, loop = case.schedule, case.loop
    instances: list[Any] = []
    try:
        job = _build(case, mode)
        out.info = layout_info(job)
        cbs, instances = _callbacks(case, mode, make)
        if case.flow == "train":
            rec = train(job, sched, cbs, run_test=case.run_test, loop=loop)
            out.train_losses, out.eval_losses = rec.train_losses, dict(rec.eval_losses)
            out.saved_weights, out.final_weights = rec.saved_weights, rec.final_weights
        elif case.flow == "eval_first":
            first = evaluate_only(job, sched, cbs, loop=loop)
            rec = train(job, sched, cbs, run_test=case.run_test, loop=loop)
            out.train_losses, out.eval_losses = rec.train_losses, {**rec.eval_losses, 0: first.eval_losses[0]}
            out.final_weights = rec.final_weights
        elif case.flow == "eval_only":
            rec = evaluate_only(job, sched, cbs, run_test=True, loop=loop)
            out.eval_losses, out.final_weights = dict(rec.eval_losses), rec.final_weights
        elif case.flow == "back_to_back":
            rec = train(job, sched, cbs, run_test=True, loop=loop)
            more = evaluate_only(job, sched, cbs, run_test=True, loop=loop)
            out.train_losses = rec.train_losses
            out.eval_losses = {**rec.eval_losses, -2: more.eval_losses[0], -3: more.eval_losses[-1]}
            out.final_weights = more.final_weights
        elif case.flow == "eval_error":
            _raise_in_eval(job, case.flow_arg, sched.eval_iters)
            try:
                train(job, sched, cbs, run_test=case.run_test, loop=loop)
                raise AssertionError("the injected eval error did not fire")
            except InjectedEvalError:
                pass
            step = case.flow_arg * sched.eval_interval
            _recover_after_eval_error(job)
            first_losses = _losses_so_far(job)
            with _start_at(step):
                rec = train(job, sched, cbs, run_test=case.run_test, loop=loop)
            out.train_losses = first_losses[:step] + rec.train_losses
            out.eval_losses, out.final_weights = dict(rec.eval_losses), rec.final_weights
            out.eval_losses.update({k: v for k, v in job.__dict__.get("_evals", {}).items() if k < step})
        elif case.flow == "resume":
            k = case.flow_arg
            rec1 = train(job, replace(sched, train_iters=k, save_interval=k), cbs, loop=loop)
            opt_state = _optimizer_state(job)
            saved = rec1.saved_weights[k]
            _record_events(out, instances)
            job = _build(case, mode)  # a fresh process would rebuild everything
            _load_checkpoint(job, saved, opt_state)
            cbs, instances = _callbacks(case, mode, make)
            with _start_at(k):
                rec = train(job, sched, cbs, run_test=case.run_test, loop=loop)
            out.train_losses = rec1.train_losses + rec.train_losses
            out.eval_losses = {**rec1.eval_losses, **rec.eval_losses}
            out.saved_weights, out.final_weights = {k: saved}, rec.final_weights
    except Exception as exc:  # noqa: BLE001 - a refusal is a result; the test decides
        out.error = f"{type(exc).__name__}: {exc}"
        out.traceback = traceback.format_exc()
    _record_events(out, instances)
    if not case.keep_weights:
        out.saved_weights, out.final_weights = {}, {}
    return out


def _losses_so_far(job: Job) -> list[float]:
    return list(job.__dict__.get("_train_losses", []))


def _record_events(out: CaseRun, instances: Sequence[Any]) -> None:
    for cb in instances:
        out.plugin_events.extend((e, asdict(s)) for e, s in cb.history)
        cb.history.clear()


MISUSE = "misuse"


def _rank_cases(cases: Sequence[Case], misuse: bool = False) -> dict[str, dict[str, CaseRun]]:
    import time

    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    results: dict[str, dict[str, CaseRun]] = {}
    with cpu_shim(), emulated_mxfp8(), _tracking_train_step():
        for case in cases:
            results[case.name] = {}
            for mode in case.modes:
                t0 = time.perf_counter()
                run = _run_mode(case, mode)
                run.seconds = time.perf_counter() - t0
                results[case.name][mode] = run
        if misuse:
            _ensure_parallel_state(1, 1)
            results[MISUSE] = {"checks": CaseRun(info=_misuse_checks())}
    return results


@contextmanager
def _tracking_train_step() -> Iterator[None]:
    """Record every step's loss and every eval's loss on the job while the loop runs, so the
    ``eval_error`` flow keeps the losses of the ``train`` call the exception cut short."""
    from . import bridge_loop

    step, evaluate = bridge_loop.train_step, bridge_loop.evaluate_and_print_results

    def train_step(job: Job, batches: Any) -> float:
        loss = step(job, batches)
        job.__dict__.setdefault("_train_losses", []).append(loss)
        return loss

    def evaluate_and_print_results(job: Job, *args: Any, **kwargs: Any) -> float:
        loss = evaluate(job, *args, **kwargs)
        state = args[2] if len(args) > 2 else kwargs.get("state")
        if not kwargs.get("is_test") and state is not None:
            job.__dict__.setdefault("_evals", {})[int(state.train_state.step)] = loss
        return loss

    bridge_loop.train_step = train_step  # type: ignore[assignment]
    bridge_loop.evaluate_and_print_results = evaluate_and_print_results  # type: ignore[assignment]
    try:
        yield
    finally:
        bridge_loop.train_step = step  # type: ignore[assignment]
        bridge_loop.evaluate_and_print_results = evaluate  # type: ignore[assignment]


def run_cases(
    cases: Sequence[Case], world_size: int = 2, *, misuse: bool = False, timeout: float = 420.0
) -> list[dict[str, dict[str, CaseRun]]]:
    """Run every case in every mode on ``world_size`` ranks in one spawn; per-rank results.

    ``misuse=True`` also runs :func:`misuse_checks` there; its outcomes are
    ``results[MISUSE]["checks"].info``.
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names) or MISUSE in names:
        raise ValueError(f"case names must be unique and not {MISUSE!r}: {names}")
    return launch(_rank_cases, world_size, list(cases), misuse, timeout=timeout)


# ----------------------------------------------------------------------------------- misuse
def _outcome(fn: Callable[[], str]) -> str:
    try:
        return "ok: " + fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return f"{type(exc).__name__}: {exc}"


def _misuse_checks() -> dict[str, str]:
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.engine.sync import ParamSyncEngine
    from mbridge_mxfp8_plugin.testing.toy import ToyModel

    case = Case("misuse")
    job = _build(case, "plugin")
    plain = ToyModel(replace(case.toy, reference=True))
    out: dict[str, str] = {}

    def ctx(model: Any, optimizer: Any = None) -> Any:
        return SimpleNamespace(model=model, optimizer=optimizer, state=None)

    def drive(model: Any, optimizer: Any) -> str:
        cb = MXFP8ParamSyncCallback()
        for event in ("on_train_start", "on_train_step_start", "on_train_step_end"):
            getattr(cb, event)(ctx(model, optimizer))
        for event in ("on_eval_start", "on_eval_end", "on_train_end"):
            getattr(cb, event)(ctx(model))
        return f"engine={cb.engine!r} reason={cb.inactive_reason}"

    out["plain_module"] = _outcome(lambda: drive([plain], job.optimizer))
    torch_ddp = torch.nn.parallel.DistributedDataParallel(ToyModel(replace(case.toy, reference=True)))
    out["torch_ddp"] = _outcome(lambda: drive([torch_ddp], None))
    torch_opt = torch.optim.Adam([p for p in job.model[0].parameters() if p.requires_grad], lr=1e-3)
    out["torch_optimizer"] = _outcome(lambda: drive(job.model, torch_opt))
    out["engine_plain_module"] = _outcome(lambda: repr(ParamSyncEngine([plain])))
    out["engine_without_optimizer_stage"] = _outcome(
        lambda: str(ParamSyncEngine(job.model).stage_main_params())
    )
    out.update(_in_flight_checks(job))
    return out


def _in_flight_checks(job: Job) -> dict[str, str]:
    """An asynchronous gather in flight (as ``overlap_param_gather_with_optimizer_step`` leaves
    one after the optimizer step) must survive every engine call but a full refresh, which waits
    for it and then re-gathers freshly staged main params."""
    from mbridge_mxfp8_plugin.engine.sync import ParamSyncEngine
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    engine = ParamSyncEngine(job.model, job.optimizer)
    engine.prepare()
    groups = engine.bucket_groups()
    out: dict[str, str] = {}
    with torch.no_grad():
        for opt in distributed_optimizers(job.optimizer):  # stands in for an optimizer step
            for group in opt.shard_fp32_from_float16_groups:
                for main in group:
                    main.add_(0.05)
    for chunk in job.model:
        chunk.zero_grad_buffer()
    engine.stage_main_params()
    groups[0].start_param_sync()  # asynchronous: overlap_param_gather=True
    handle = groups[0].param_gather_handle
    out["in_flight_dispatched"] = (
        f"handle={handle is not None} dispatched={groups[0].param_gather_dispatched}"
    )
    stats = engine.step_started()
    out["in_flight_restore"] = (
        f"groups_reset={stats.groups_reset} handle_kept={groups[0].param_gather_handle is handle} "
        f"dispatched={groups[0].param_gather_dispatched}"
    )
    out["in_flight_stage"] = f"staged={engine.stage_main_params()}"
    ParamSyncEngine(job.model).before_eval()  # no optimizer bound: holds the weights as they are
    out["in_flight_hold"] = f"handle_kept={groups[0].param_gather_handle is handle}"
    out["in_flight_weights_before_refresh"] = str(max_weight_error(job))
    stats = engine.refresh_weights()
    out["in_flight_refresh"] = (
        f"all_gathers={stats.all_gathers} handle={groups[0].param_gather_handle} "
        f"dispatched={all(g.param_gather_dispatched for g in groups)}"
    )
    out["in_flight_weights_after_refresh"] = str(max_weight_error(job))
    return out


def max_weight_error(job: Job) -> float:
    """max |param.data - main param rounded to the param's format| over every trainable param.

    The full main param is assembled from every rank's shard (``param.main_param``, disjoint
    ranges, summed with an all-reduce over the bucket group's distributed-optimizer group; every
    rank visits every param in the same order); rounding follows the write-back path:
    fp32 -> bf16 (the gathered buffer) -> MXFP8 for quantized params.
    """
    from megatron.core import fp8_utils

    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_quantize

    ranges: dict[Any, Any] = {}
    for opt in distributed_optimizers(job.optimizer):
        for model_group in opt.model_float16_groups:
            for p in model_group:
                ranges[p] = opt._get_model_param_range_map(p)["param"]
    worst = 0.0
    for chunk in job.model:
        for p in chunk.parameters():
            if p not in chunk.param_to_bucket_group:
                continue
            full = torch.zeros(p.numel(), dtype=torch.float32)
            main = getattr(p, "main_param", None)
            if p in ranges and main is not None:
                r = ranges[p]
                full[r.start : r.end] = main.detach().float()
            group = chunk.param_to_bucket_group[p].intra_distributed_optimizer_instance_group
            torch.distributed.all_reduce(full, group=group)
            want = full.to(torch.bfloat16).float().view(p.shape)
            if fp8_utils.is_mxfp8tensor(p):
                want = mxfp8_quantize(want)
            worst = max(worst, float((p.detach().float() - want).abs().max()))
    return worst
