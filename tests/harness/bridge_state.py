"""What the loop replica (:mod:`.bridge_loop`) reads and records: the schedule (``cfg.train`` /
``cfg.checkpoint`` knobs), the slice of Bridge's ``GlobalState`` its callbacks read, the signal
handler and the async-save finalizers, and the run record the order tests read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from .bridge_orders import LoopOrder, loop_order
from .weights import RunRecord

__all__ = ["BridgeLoopRun", "LoopSchedule"]


@dataclass(frozen=True)
class LoopSchedule:
    """When the loop evaluates and saves; mirrors the ``cfg.train`` / ``cfg.checkpoint`` knobs."""

    train_iters: int = 9
    eval_interval: int = 3
    eval_iters: int = 2
    save_interval: int | None = None
    num_microbatches: int = 1
    #: ``cfg.train.check_weight_hash_across_dp_replicas_interval``: a forced sync with no callback.
    weight_hash_interval: int | None = None
    #: ``cfg.checkpoint.non_persistent_save_interval`` (the ``elif`` after the regular save).
    non_persistent_save_interval: int | None = None
    #: ``cfg.train.exit_interval``: save (when saving is on) and leave the loop at these steps.
    exit_interval: int | None = None
    #: SIGTERM reaches every rank during this iteration (0-based), i.e. before its
    #: ``on_train_step_end``; ``cfg.train.exit_signal_handler`` is on whenever this is set.
    signal_at_iteration: int | None = None
    #: ``cfg.train.exit_duration_in_mins`` runs out during this iteration (0-based).
    exit_duration_at_iteration: int | None = None
    #: ``cfg.checkpoint.save`` without any interval: only exit/end-of-run saves.
    save_on_exit: bool = False
    #: ``cfg.checkpoint.async_save``: Bridge >= 0.5 fires ``on_checkpoint_save`` when the save is
    #: finalized, at the top of a later iteration or after the closing disable (0.5.1 L359/L767).
    async_save: bool = False

    @property
    def saves(self) -> bool:
        return bool(self.save_interval or self.non_persistent_save_interval or self.save_on_exit)


@dataclass
class BridgeLoopRun(RunRecord):
    """A :class:`~harness.weights.RunRecord` plus what the loop did, for the order tests."""

    #: callbacks fired and forced syncs issued, in order
    events: list[str] = field(default_factory=list)
    #: weights seen by the weight-hash check, by step
    hashed_weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def _make_state(schedule: LoopSchedule, order: LoopOrder | None = None) -> Any:
    """The slice of Bridge's ``GlobalState`` that callbacks read (``state.cfg``, ``state.train_state``)."""
    order = order or loop_order()
    train = SimpleNamespace(
        train_iters=schedule.train_iters,
        # 0.4+: deprecated copies, None unless set (0.4.2 config.py L549-552).
        eval_interval=None if order.validation_config else schedule.eval_interval,
        eval_iters=None if order.validation_config else schedule.eval_iters,
        exit_interval=schedule.exit_interval,
        exit_signal_handler=schedule.signal_at_iteration is not None,
        exit_duration_in_mins=None if schedule.exit_duration_at_iteration is None else _EXIT_DURATION_MINS,
        skip_train=False,
    )
    ckpt = SimpleNamespace(
        save="/tmp/replica" if schedule.saves else None,
        save_interval=schedule.save_interval,
        non_persistent_save_interval=schedule.non_persistent_save_interval,
        async_save=schedule.async_save,
    )
    cfg = SimpleNamespace(train=train, checkpoint=ckpt)
    if order.validation_config:
        cfg.validation = SimpleNamespace(
            eval_interval=schedule.eval_interval,
            eval_iters=schedule.eval_iters,
            start_eval_at_iter=None,
            skip_train=False,
        )
    return SimpleNamespace(
        cfg=cfg,
        train_state=SimpleNamespace(step=0, do_valid=True, do_test=False),
        start_time=time.time(),  # GlobalState.start_time (0.3.1 state.py L133)
        # GlobalState._signal_handler (lazily built by the signal_handler property, 0.3.1 L327-331)
        _signal_handler=_SignalHandler() if schedule.signal_at_iteration is not None else None,
        # finalize functions of async saves not yet finalized (AsyncRequest.add_finalize_fn)
        async_pending=[] if schedule.async_save else None,
    )


def _finalize_async_saves(state: Any, record: BridgeLoopRun) -> None:
    """``checkpoint_manager.finalize_async_saves`` (0.5.1 L359 non-blocking at the top of each
    iteration, L767/L783 blocking after the closing disable; 0.6.2 L389/L782/L798): the write is
    taken to have finished by the next call, so every queued finalize function runs there."""
    pending = state.async_pending
    while pending:
        pending.pop(0)()
        record.events.append("finalize_async_save")


_EXIT_DURATION_MINS = 60.0


class _SignalHandler:
    """``DistributedSignalHandler`` (utils/sig_utils.py, 0.3.1 L93-141): the handler sets a local
    flag; ``signals_received()`` all-gathers it (a real collective, as in Bridge)."""

    def __init__(self) -> None:
        self._signal_received = False

    def signals_received(self) -> list[bool]:
        flag = torch.tensor([int(self._signal_received)], dtype=torch.int32, device="cuda")
        out = [torch.zeros_like(flag) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(out, flag)
        return [bool(t.item()) for t in out]
