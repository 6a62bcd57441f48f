"""A faithful replica of Megatron-Bridge's train/eval loop order, firing Bridge's real callbacks.

Bridge's own ``pretrain()`` runs in the tests too (``tests/bridge_real/test_bridge_real.py``, on CPU through
``harness.bridge_cpu``), and ``test_replica_loop_makes_the_same_calls_as_real_pretrain`` checks, for
every Bridge release CI covers, that this replica and the real loop make the same calls in the same
order (callback events, pre-hook toggles, forced syncs, main-param staging; recorded by
:func:`recording_param_syncs`). The replica is kept for what the real loop cannot do here, or
not in seconds: loop orders of Bridge releases on megatron-core releases they do not install with
(core 0.14 / 0.15 and the "other pairs" of docs/compatibility.md); schedules placed exactly on an
iteration (SIGTERM and exit-duration saves, async-save finalization, weight-hash checks, an
exception inside eval, eval-only jobs); the toy layouts of docs/robustness.md (MoE EP=2, several
optimizer instances, frozen/tied/odd-sized params) and the 200-step soak, each a fraction of a
second per mode where a real ``pretrain()`` costs ~40 s of imports; and ``mxfp8-plugin demo``,
which must run without Bridge's dependency tree.

The order in which Bridge's ``train()`` toggles forward pre-hooks, stages main params, forces param
syncs and fires callbacks is what decides whether MXFP8 weights are right. This module reproduces
that order line for line
for megatron-bridge 0.3.1 (the default), 0.4.2, 0.5.1 and 0.6.2 (``train(..., loop="0.5.1")``;
:class:`LoopOrder` lists what differs, with references to each release's
``megatron/bridge/training/{train,eval,pretrain,checkpointing}.py``) around a toy forward/backward,
and fires events through the real ``CallbackManager`` loaded by file path from the installed
megatron-bridge wheel (:func:`load_bridge_callbacks`; callbacks.py is byte-identical in 0.3.1/0.4.2
and in 0.5.1/0.6.2). :func:`evaluate_only` is pretrain's ``skip_train`` path.

This module holds ``train()`` and ``evaluate_only()``; the pieces they replay are one module each,
re-exported here: the releases (:mod:`.bridge_orders`), the schedule, state and run record
(:mod:`.bridge_state`), Bridge's callbacks and the call record (:mod:`.bridge_callbacks`), the
``train.py`` helpers, ``train_step`` and the eval (:mod:`.bridge_steps`), the saves
(:mod:`.bridge_saves`), and the loop API in a loop that stages itself (:mod:`.bridge_staging`).
Tests patch ``train_step``, ``evaluate_and_print_results`` and ``_make_state`` on this module:
``train()`` and ``evaluate_only()`` look them up here.
"""

from __future__ import annotations

import sys
import time
from types import ModuleType
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.toy import Job, make_batches

from .bridge_callbacks import find_bridge_file, load_bridge_callbacks, recording_param_syncs
from .bridge_orders import LOOP_ORDERS, LoopOrder, loop_order, replica_release
from .bridge_saves import _checkpoint_and_decide_exit, _save
from .bridge_staging import run_api_with_staging_loop
from .bridge_state import _EXIT_DURATION_MINS, BridgeLoopRun, LoopSchedule, _finalize_async_saves, _make_state
from .bridge_steps import (
    _TRAIN_MODULE,
    _bridge_train_module,
    _stage_like_bridge_051,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    evaluate_and_print_results,
    train_step,
)
from .weights import weights_of

__all__ = [
    "LOOP_ORDERS",
    "LoopOrder",
    "LoopSchedule",
    "BridgeLoopRun",
    "evaluate_and_print_results",
    "evaluate_only",
    "find_bridge_file",
    "load_bridge_callbacks",
    "loop_order",
    "recording_param_syncs",
    "replica_release",
    "run_api_with_staging_loop",
    "train",
    "train_step",
]


def train(
    job: Job,
    schedule: LoopSchedule,
    callbacks: list[Any] | None = None,
    *,
    callbacks_module: ModuleType | None = None,
    run_test: bool = False,
    loop: str | LoopOrder | None = None,
    run_valid: bool = False,
) -> BridgeLoopRun:
    """train.py ``train()`` (+ pretrain.py's closing evals) of the given Bridge release, in its order.

    ``loop`` picks the release (``"0.3.1"`` default, ``"0.4.2"``, ``"0.5.1"``, ``"0.6.2"`` or X.Y).
    Line references: 0.3.1 L87-637 | 0.4.2 L91-670 | 0.5.1 L113-805 | 0.6.2 L125-820.
    ``schedule.save_interval`` adds interval saves and the release's end-of-run save
    (``record.saved_weights[step]`` / ``[-1]``); ``schedule.weight_hash_interval`` adds the
    weight-hash check (forced sync without a callback).
    """
    order = loop_order(loop)
    cb = callbacks_module or load_bridge_callbacks()
    manager = cb.CallbackManager()
    if callbacks:
        manager.add(callbacks)  # what pretrain(..., callbacks=[...]) does via normalize_callbacks
    ctx = cb.CallbackContext
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = _make_state(schedule, order)
    model, optimizer = job.model, job.optimizer
    record = BridgeLoopRun()
    eval_batches = make_batches(job.toy, schedule.eval_iters, rank=rank, world=world, salt=99991)
    stage_opt = optimizer if order.optimizer_prepares_sync else None
    hash_interval = getattr(schedule, "weight_hash_interval", None)

    def fire(event: str, **extra: Any) -> None:
        if cb.should_fire(manager, event):
            extra.setdefault("model", model)
            manager.fire(event, ctx(state=state, user_state=manager.user_state, **extra))
            record.events.append(event)

    saved_modules = {k: sys.modules.get(k) for k in (_TRAIN_MODULE,)}
    sys.modules[_TRAIN_MODULE] = _bridge_train_module(order)
    try:
        # should_disable_forward_pre_hook (0.3.1 L912): not fsdp and distopt and overlap.
        toggle = bool(job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather)
        pre_hook_enabled = True
        if order.on_train_start_before_disable:
            fire("on_train_start", optimizer=optimizer)  # 0.4.2 L266, 0.5.1 L323, 0.6.2 L349
        if toggle:  # 0.3.1 L226-232, 0.4.2 L281-287, 0.5.1 L338-344, 0.6.2 L364-372 (fresh run)
            disable_forward_pre_hook(model, param_sync=False)
            record.events.append("disable_forward_pre_hook(param_sync=False)")
            pre_hook_enabled = False
        if not order.on_train_start_before_disable:
            fire("on_train_start", optimizer=optimizer)  # 0.3.1 L270-279
        start_iteration = state.train_state.step
        should_exit = False
        while state.train_state.step < schedule.train_iters:
            it = state.train_state.step
            _finalize_async_saves(state, record)
            fire("on_train_step_start", optimizer=optimizer)  # 0.3.1 L351, 0.6.2 L454
            batches = make_batches(job.toy, schedule.num_microbatches, rank=rank, world=world, salt=it)
            record.train_losses.append(train_step(job, batches))
            if it == schedule.signal_at_iteration:  # SIGTERM arrives while the step runs
                state._signal_handler._signal_received = True
            if it == schedule.exit_duration_at_iteration:  # the time budget runs out during the step
                state.start_time = time.time() - 60.0 * _EXIT_DURATION_MINS - 1.0
            fire("on_train_step_end", optimizer=optimizer)  # 0.3.1 L385, 0.6.2 L497
            if it == start_iteration and toggle and not pre_hook_enabled:  # 0.3.1 L419-436, 0.6.2 L535-549
                enable_forward_pre_hook(model)
                pre_hook_enabled = True
            state.train_state.step += 1  # 0.3.1 L445
            step = state.train_state.step
            if schedule.eval_interval and step % schedule.eval_interval == 0:
                # 0.3.1 L501-540 | 0.4.2 L512-549 | 0.5.1 L635-684 | 0.6.2 L657-698
                if (
                    order.stage_before_eval
                    and job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag
                    and (job.ddp_config.overlap_param_gather)
                ):
                    _stage_like_bridge_051(job)  # 0.5.1 L646-653
                    record.events.append("stage_main_params(0.5)")
                if toggle:
                    disable_forward_pre_hook(model, optimizer=stage_opt)  # forced all-gather before eval
                    record.events.append("disable_forward_pre_hook")
                    pre_hook_enabled = False
                record.eval_losses[step] = evaluate_and_print_results(
                    job, manager, cb, state, eval_batches, loop=order, record=record
                )
                if toggle:
                    enable_forward_pre_hook(model)
                    pre_hook_enabled = True
            if hash_interval and step % hash_interval == 0:
                # maybe_check_weight_hash_across_dp_replicas: 0.3.1 L868-896, 0.6.2 L1065-1095
                if toggle:
                    disable_forward_pre_hook(model, optimizer=stage_opt)
                    record.events.append("disable_forward_pre_hook(hash)")
                record.hashed_weights[step] = weights_of(model)
                if toggle:
                    enable_forward_pre_hook(model)
            should_exit = _checkpoint_and_decide_exit(job, order, fire, record, state)
            if should_exit:
                break
        # End-of-run save when training completed normally and the last step was not saved
        # (0.4.2 L595-613, 0.5.1 L733-751, 0.6.2 L749-770).
        ckpt = state.cfg.checkpoint
        if (
            order.final_save_in_train
            and not should_exit
            and ckpt.save
            and state.train_state.step != 0
            and ckpt.save_interval != 0
            and (ckpt.save_interval is None or state.train_state.step % ckpt.save_interval != 0)
        ):
            _save(job, order, fire, record, -1, pending=state.async_pending)
        if pre_hook_enabled:  # 0.3.1 L594-595, 0.6.2 L776-777 (optimizer=optimizer)
            disable_forward_pre_hook(model, optimizer=stage_opt)
            record.events.append("disable_forward_pre_hook(final)")
        _finalize_async_saves(state, record)  # blocking, before on_train_end / sys.exit
        if should_exit:  # 0.3.1 L613-624, 0.6.2 L795-805: sys.exit before on_train_end
            record.events.append("sys.exit")
            record.final_weights = weights_of(model)
            return record
        fire("on_train_end", optimizer=optimizer)  # 0.3.1 L626, 0.4.2 L658, 0.5.1 L795, 0.6.2 L810
    finally:
        for k, v in saved_modules.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    # pretrain.py 0.3.1 L157-166: end-of-run save_checkpoint, no forced sync, after train().
    ckpt = state.cfg.checkpoint
    step = state.train_state.step
    if not order.final_save_in_train and ckpt.save and step != 0 and ckpt.save_interval != 0:
        _save(job, order, fire, record, -1, forced=False)
    if run_valid:  # pretrain.py (0.3.1 L175-187, 0.6.2 L171-182): validation after train(), no toggling
        record.eval_losses[-2] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, loop=order, record=record
        )
    if run_test:  # pretrain.py (0.3.1 L190-201): test evaluation after train(), no hook toggling
        record.eval_losses[-1] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, is_test=True, loop=order, record=record
        )
    record.final_weights = weights_of(model)
    return record


def evaluate_only(
    job: Job,
    schedule: LoopSchedule,
    callbacks: list[Any] | None = None,
    *,
    callbacks_module: ModuleType | None = None,
    run_test: bool = False,
    loop: str | LoopOrder | None = None,
) -> BridgeLoopRun:
    """pretrain.py with ``skip_train`` (0.3.1 L141/L175-201, 0.6.2 L148-197): no ``train()`` at all.

    Deliberately :func:`train`'s signature (duplicates lists the pair): scenarios call either one.
    The forward pre-hooks stay enabled as ``DistributedDataParallel.__init__`` left them, nothing
    stages main params, and no callback ever sees the optimizer. ``record.eval_losses[0]`` is the
    validation loss, ``[-1]`` the test loss.
    """
    order = loop_order(loop)
    cb = callbacks_module or load_bridge_callbacks()
    manager = cb.CallbackManager()
    if callbacks:
        manager.add(callbacks)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = _make_state(schedule, order)
    if order.validation_config:
        state.cfg.validation.skip_train = True
    else:
        state.cfg.train.skip_train = True
    record = BridgeLoopRun()
    eval_batches = make_batches(job.toy, schedule.eval_iters, rank=rank, world=world, salt=99991)
    record.eval_losses[0] = evaluate_and_print_results(
        job, manager, cb, state, eval_batches, loop=order, record=record
    )
    if run_test:
        record.eval_losses[-1] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, is_test=True, loop=order, record=record
        )
    record.final_weights = weights_of(job.model)
    return record
