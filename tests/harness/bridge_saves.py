"""Megatron-Bridge's saves, replayed for the loop replica (:mod:`.bridge_loop`): ``save_checkpoint_and_time``
and ``checkpoint_and_decide_exit`` (signal, interval, non-persistent, duration and exit-interval saves).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.toy import Job

from .bridge_orders import LoopOrder
from .bridge_state import BridgeLoopRun
from .bridge_steps import force_param_sync
from .weights import weights_of


def _save(
    job: Job,
    order: LoopOrder,
    fire: Any,
    record: BridgeLoopRun,
    key: int,
    *,
    forced: bool = True,
    pending: list[Any] | None = None,
) -> None:
    """``save_checkpoint_and_time`` (0.3.1 L1055-1127, 0.4.2 L1092, 0.5.1 L1241-1331, 0.6.2 L1269-1359).

    No callback before the write in any release; the pre-hooks stay enabled. ``forced=False`` is
    0.3.1's end-of-run ``save_checkpoint`` in pretrain.py L158, which does not force a sync.
    """
    model = job.model
    toggle = bool(job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather)
    if forced and toggle:
        # 0.3.1 L1101-1102 / 0.6.2 L1320-1321 (optimizer=optimizer: stages first)
        force_param_sync(model, job.optimizer if order.optimizer_prepares_sync else None)
        record.events.append("force_param_sync")
    if forced and order.frees_overlap_buffers:  # 0.4.2 L1143-1146
        for chunk in model:
            if hasattr(chunk, "free_overlap_buffers"):
                chunk.free_overlap_buffers()
    record.saved_weights[key] = weights_of(model)  # what dist-checkpointing writes: param.data
    if order.fires_on_checkpoint_save:  # 0.5.1 checkpointing.py L1243-1261 (sync save)
        # save_checkpoint unwrapped the model first (0.6.2 checkpointing.py L1120): the context
        # carries the bare modules, not the DDP chunks the other events carry.
        from megatron.core.utils import unwrap_model

        bare = unwrap_model(list(model))
        if pending is None:
            fire("on_checkpoint_save", optimizer=job.optimizer, model=bare)
        else:  # async: add_finalize_fn(fire_callback), L1258
            pending.append(lambda: fire("on_checkpoint_save", optimizer=job.optimizer, model=bare))


def _checkpoint_and_decide_exit(
    job: Job, order: LoopOrder, fire: Any, record: BridgeLoopRun, state: Any
) -> bool:
    """``checkpoint_and_decide_exit`` (0.3.1 L1130-1263, 0.6.2 L1362-1500; same branches in all four):
    signal -> save + exit; regular save, elif non-persistent save; duration -> save unless saved +
    exit; exit_interval -> save unless saved + exit. Every save is ``save_checkpoint_and_time``."""
    train, ckpt, step = state.cfg.train, state.cfg.checkpoint, state.train_state.step

    def save() -> None:
        _save(job, order, fire, record, step, pending=state.async_pending)

    if train.exit_signal_handler and any(state._signal_handler.signals_received()):
        if ckpt.save:
            save()
        return True
    saved = False
    if ckpt.save and ckpt.save_interval and step % ckpt.save_interval == 0:
        save()
        saved = True
    elif ckpt.save and ckpt.non_persistent_save_interval and step % ckpt.non_persistent_save_interval == 0:
        save()
        saved = True
    if train.exit_duration_in_mins:
        over = (time.time() - state.start_time) / 60.0 > train.exit_duration_in_mins
        done = torch.tensor([int(over)], dtype=torch.int, device="cuda")
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        if done.item():
            if ckpt.save and not saved:
                save()
            return True
    if train.exit_interval and step % train.exit_interval == 0:
        if ckpt.save and not saved:
            save()
        return True
    return False
