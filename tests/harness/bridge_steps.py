"""Megatron-Bridge's ``train.py`` helpers, ``train_step`` and ``evaluate_and_print_results``, replayed in
each release's order (:class:`~.bridge_orders.LoopOrder`) for the loop replica (:mod:`.bridge_loop`),
with the stand-in for ``megatron.bridge.training.train`` by which the plugin recognises a loop that
stages before every forced sync.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.megatron_lm_loop import dp_mean
from mbridge_mxfp8_plugin.testing.toy import Job

from .bridge_orders import LoopOrder, loop_order
from .bridge_state import BridgeLoopRun

__all__ = [
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "evaluate_and_print_results",
    "force_param_sync",
    "train_step",
]

_TRAIN_MODULE = "megatron.bridge.training.train"


# -- train.py helpers (0.3.1: L935-966; 0.6.2: L1134-1173) ------------------------------------
def enable_forward_pre_hook(model: list[Any]) -> None:
    for chunk in model:
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True, *, optimizer: Any = None) -> None:
    """0.3.1 L946-955; with ``optimizer`` the 0.6.2 variant (L1145-1159) that stages first."""
    if param_sync and optimizer is not None:
        optimizer.prepare_model_params_for_param_sync()
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def force_param_sync(model: list[Any], optimizer: Any = None) -> None:
    """0.3.1 L958-966; with ``optimizer`` the 0.6.2 variant (L1162-1173) that stages first."""
    if optimizer is not None:
        optimizer.prepare_model_params_for_param_sync()
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def _bridge_train_module(order: LoopOrder) -> ModuleType:
    """A stand-in for ``megatron.bridge.training.train`` exposing that release's helper signatures.

    The plugin recognises a loop that stages main params before every forced sync (0.6+) from the
    signatures of the loaded Bridge ``train`` module's ``force_param_sync`` /
    ``disable_forward_pre_hook`` (see :func:`mbridge_mxfp8_plugin.upstream.probe_live_bridge_loop`).
    """
    mod = ModuleType("megatron.bridge.training.train")
    mod.__dict__["__replica_release__"] = order.release
    mod.__dict__["enable_forward_pre_hook"] = enable_forward_pre_hook
    if order.optimizer_prepares_sync:

        def disable_hooks(model: list[Any], optimizer: Any = None, param_sync: bool = True) -> None:
            disable_forward_pre_hook(model, param_sync, optimizer=optimizer)

        def force_sync(model: list[Any], optimizer: Any = None) -> None:
            force_param_sync(model, optimizer)
    else:

        def disable_hooks(model: list[Any], param_sync: bool = True) -> None:  # type: ignore[misc]
            disable_forward_pre_hook(model, param_sync)

        def force_sync(model: list[Any]) -> None:  # type: ignore[misc]
            force_param_sync(model)

    mod.__dict__["disable_forward_pre_hook"] = disable_hooks
    mod.__dict__["force_param_sync"] = force_sync
    return mod


def _handle_mxfp8_param_buffer_copy(optimizer: Any, model: list[Any], reuse: bool, overlap: bool) -> None:
    """train.py 0.3.1 L1350-1380 (0.6.2 L1613-1649 adds full-iteration CUDA graphs only): stage main
    params into the shared buffer, only with pre-hooks on."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if reuse and overlap:
        if len(model[0].remove_forward_pre_hook_handles) > 0:
            for opt in optimizer.chained_optimizers:
                if isinstance(opt, DistributedOptimizer):
                    opt._copy_main_params_to_param_buffer()


def train_step(job: Job, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """train.py ``train_step`` (0.3.1 L639-720, 0.6.2 L824-) with megatron-core's no-pipelining
    schedule inlined. The order inside is the same in every release (0.3.1 L680-690, 0.4.2 L713-723,
    0.5.1 L850-860, 0.6.2 L866-876)."""
    model, optimizer = job.model, job.optimizer
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    _handle_mxfp8_param_buffer_copy(
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
    return dp_mean(torch.stack(losses).mean())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def evaluate_and_print_results(
    job: Job,
    manager: Any,
    callbacks_mod: ModuleType,
    state: Any,
    eval_batches: list[Any],
    *,
    is_test: bool = False,
    loop: str | LoopOrder | None = None,
    record: BridgeLoopRun | None = None,
) -> float:
    """eval.py ``evaluate_and_print_results`` + ``evaluate`` (0.3.1 L278-386 / L42-275).

    Eval and test contexts carry no optimizer in any release. Where the start/end events fire
    relative to ``model.eval()`` / ``model.train()`` depends on the release (see :class:`LoopOrder`).
    """
    order = loop_order(loop)
    start, end = ("on_test_start", "on_test_end") if is_test else ("on_eval_start", "on_eval_end")
    ctx = callbacks_mod.CallbackContext

    def fire(event: str, **extra: Any) -> None:
        if callbacks_mod.should_fire(manager, event):
            manager.fire(event, ctx(state=state, model=job.model, user_state=manager.user_state, **extra))
            if record is not None:
                record.events.append(event)

    if not order.eval_events_inside_evaluate:
        fire(start)  # 0.3.1 eval.py L320 (0.4.2 L343, 0.5.1 L412): before evaluate()
    for chunk in job.model:  # evaluate(): 0.3.1 L86-87, 0.6.2 L108-109
        chunk.eval()
    if order.eval_events_inside_evaluate:
        fire(start)  # 0.6.2 eval.py L111: after model.eval()
    losses = []
    with torch.no_grad():
        for x, y in eval_batches:
            losses.append(job.model[0](x, y))
    loss = dp_mean(torch.stack(losses).mean())
    if order.eval_events_inside_evaluate:
        fire(end, total_loss_dict={"lm loss": loss})  # 0.6.2 eval.py L371: before model.train()
    for chunk in job.model:  # 0.3.1 L263-264, 0.6.2 L383-384
        chunk.train()
    if not order.eval_events_inside_evaluate:
        fire(end, total_loss_dict={"lm loss": loss})  # 0.3.1 eval.py L377: after evaluate() returned
    return loss


def _stage_like_bridge_051(job: Job) -> None:
    """0.5.1 train.py L646-653, verbatim order: zero every grad buffer, then stage each DistOpt."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for chunk in job.model:
        chunk.zero_grad_buffer()
    for opt in job.optimizer.chained_optimizers:
        if isinstance(opt, DistributedOptimizer):
            opt._copy_main_params_to_param_buffer()
