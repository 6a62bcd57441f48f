"""A faithful replica of Megatron-Bridge's train/eval loop order, firing Bridge's real callbacks.

Megatron-Bridge itself cannot be imported without Transformer Engine, but the order in which its
``train()`` toggles forward pre-hooks, stages main params, forces param syncs and fires callbacks
is what decides whether MXFP8 weights are right. This module reproduces that order line for line
(references are to ``megatron/bridge/training/train.py`` and ``eval.py`` of megatron-bridge 0.3.1)
around a toy forward/backward, and fires events through the real ``CallbackManager`` loaded by
file path from an installed megatron-bridge wheel (:func:`load_bridge_callbacks`).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from .toy import Job, make_batches

__all__ = ["LoopSchedule", "RunRecord", "find_bridge_file", "load_bridge_callbacks", "train"]


def find_bridge_file(relative: str = "training/callbacks.py") -> Path:
    """Locate a file of the installed megatron-bridge distribution without importing the package."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / "bridge" / relative
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"megatron/bridge/{relative} not found; install the wheel without its dependencies: "
        "pip install --no-deps megatron-bridge==0.3.1"
    )


def load_bridge_callbacks(path: str | Path | None = None) -> ModuleType:
    """Load ``megatron/bridge/training/callbacks.py`` by file path (it needs only the stdlib)."""
    file = Path(path) if path else find_bridge_file()
    name = "_bridge_callbacks_" + str(abs(hash(str(file))))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class LoopSchedule:
    """When the loop evaluates and saves; mirrors the ``cfg.train`` / ``cfg.checkpoint`` knobs."""

    train_iters: int = 9
    eval_interval: int = 3
    eval_iters: int = 2
    save_interval: int | None = None
    num_microbatches: int = 1


@dataclass
class RunRecord:
    """Losses the run produced (DP-averaged, identical on every rank) and forced-sync snapshots."""

    train_losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    saved_weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    final_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _dp_mean(value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(t)
    return float(t.item() / torch.distributed.get_world_size())


def _weights(model: list[Any]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.detach().float().clone() for i, chunk in enumerate(model) for n, p in chunk.named_parameters()
    }


def _make_state(schedule: LoopSchedule) -> Any:
    """The slice of Bridge's ``GlobalState`` that callbacks read (``state.cfg``, ``state.train_state``)."""
    train = SimpleNamespace(
        train_iters=schedule.train_iters,
        eval_interval=schedule.eval_interval,
        eval_iters=schedule.eval_iters,
        exit_interval=None,
    )
    ckpt = SimpleNamespace(save="/tmp/replica" if schedule.save_interval else None, save_interval=schedule.save_interval)
    cfg = SimpleNamespace(train=train, checkpoint=ckpt)
    return SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0, do_valid=True, do_test=False))


# -- train.py helpers (0.3.1: L935-966) -------------------------------------------------------
def enable_forward_pre_hook(model: list[Any]) -> None:
    for chunk in model:
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True) -> None:
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def force_param_sync(model: list[Any]) -> None:
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def _handle_mxfp8_param_buffer_copy(optimizer: Any, model: list[Any], reuse: bool, overlap: bool) -> None:
    """train.py L1350-1380: stage main params into the shared buffer, only with pre-hooks on."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if reuse and overlap:
        if len(model[0].remove_forward_pre_hook_handles) > 0:
            for opt in optimizer.chained_optimizers:
                if isinstance(opt, DistributedOptimizer):
                    opt._copy_main_params_to_param_buffer()


def train_step(job: Job, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """train.py ``train_step`` L639-720 with megatron-core's no-pipelining schedule inlined."""
    model, optimizer = job.model, job.optimizer
    for chunk in model:  # L681-682
        chunk.zero_grad_buffer()
    optimizer.zero_grad()  # L683
    _handle_mxfp8_param_buffer_copy(  # L685-690
        optimizer,
        model,
        job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag,
        job.ddp_config.overlap_param_gather,
    )
    # forward_backward_no_pipelining: no_sync for all but the last microbatch, then
    # finalize_model_grads -> finish_grad_sync on every chunk.
    losses = []
    for i, (x, y) in enumerate(batches):
        ctx = model[0].no_sync() if i < len(batches) - 1 else _null()
        with ctx:
            loss = model[0](x, y)
            (loss / len(batches)).backward()
        losses.append(loss.detach())
    for chunk in model:
        chunk.finish_grad_sync()
    optimizer.step()
    return _dp_mean(torch.stack(losses).mean())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def evaluate_and_print_results(
    job: Job, manager: Any, callbacks_mod: ModuleType, state: Any, eval_batches: list[Any], *, is_test: bool = False
) -> float:
    """eval.py ``evaluate_and_print_results`` L278-386 and ``evaluate`` L42-275."""
    start, end = ("on_test_start", "on_test_end") if is_test else ("on_eval_start", "on_eval_end")
    ctx = callbacks_mod.CallbackContext
    if callbacks_mod.should_fire(manager, start):  # L320: no optimizer in eval contexts
        manager.fire(start, ctx(state=state, model=job.model, user_state=manager.user_state))
    for chunk in job.model:  # evaluate() L86-87
        chunk.eval()
    losses = []
    with torch.no_grad():
        for x, y in eval_batches:
            losses.append(job.model[0](x, y))
    for chunk in job.model:  # L263-264
        chunk.train()
    loss = _dp_mean(torch.stack(losses).mean())
    if callbacks_mod.should_fire(manager, end):  # L377
        manager.fire(end, ctx(state=state, model=job.model, user_state=manager.user_state, total_loss_dict={"lm loss": loss}))
    return loss


def train(
    job: Job,
    schedule: LoopSchedule,
    callbacks: list[Any] | None = None,
    *,
    callbacks_module: ModuleType | None = None,
    run_test: bool = False,
) -> RunRecord:
    """train.py ``train()`` of megatron-bridge 0.3.1, L87-637, in its order of operations."""
    cb = callbacks_module or load_bridge_callbacks()
    manager = cb.CallbackManager()
    if callbacks:
        manager.add(callbacks)  # what pretrain(..., callbacks=[...]) does via normalize_callbacks
    ctx = cb.CallbackContext
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = _make_state(schedule)
    model, optimizer = job.model, job.optimizer
    record = RunRecord()
    eval_batches = make_batches(job.toy, schedule.eval_iters, rank=rank, world=world, salt=99991)

    def fire(event: str, **extra: Any) -> None:
        if cb.should_fire(manager, event):
            manager.fire(event, ctx(state=state, model=model, user_state=manager.user_state, **extra))

    # L218-232: DistOpt + overlap_param_gather -> first iteration runs without pre-hooks.
    toggle = bool(job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather)
    pre_hook_enabled = True
    if toggle:
        disable_forward_pre_hook(model, param_sync=False)
        pre_hook_enabled = False
    fire("on_train_start", optimizer=optimizer)  # L270-279
    start_iteration = state.train_state.step
    while state.train_state.step < schedule.train_iters:
        it = state.train_state.step
        fire("on_train_step_start", optimizer=optimizer)  # L351-360
        batches = make_batches(job.toy, schedule.num_microbatches, rank=rank, world=world, salt=it)
        record.train_losses.append(train_step(job, batches))
        fire("on_train_step_end", optimizer=optimizer)  # L385-397
        if it == start_iteration and toggle:  # L419-434: enable pre-hooks after the first step
            enable_forward_pre_hook(model)
            pre_hook_enabled = True
        state.train_state.step += 1
        step = state.train_state.step
        if schedule.eval_interval and step % schedule.eval_interval == 0:  # L501-540
            if toggle:
                disable_forward_pre_hook(model)  # forced all-gather before eval
                pre_hook_enabled = False
            record.eval_losses[step] = evaluate_and_print_results(job, manager, cb, state, eval_batches)
            if toggle:
                enable_forward_pre_hook(model)
                pre_hook_enabled = True
        # checkpoint_and_decide_exit -> save_checkpoint_and_time L1096-1102: forced sync, no callback.
        if schedule.save_interval and step % schedule.save_interval == 0:
            if toggle:
                force_param_sync(model)
            record.saved_weights[step] = _weights(model)
    if pre_hook_enabled:  # L594-595: close out pre-hooks (one more forced sync)
        disable_forward_pre_hook(model)
    fire("on_train_end", optimizer=optimizer)  # L626-635
    if run_test:  # pretrain.py: test evaluation after train()
        record.eval_losses[-1] = evaluate_and_print_results(job, manager, cb, state, eval_batches, is_test=True)
    record.final_weights = _weights(model)
    return record
