"""Megatron-Bridge adapter: :class:`MXFP8ParamSyncCallback` for ``pretrain(..., callbacks=[...])``.

Duck-typed against ``megatron.bridge.training.callbacks.Callback`` (``CallbackManager.add`` keys
on method names), so importing this module never imports Megatron-Bridge.

What each hook reads and does (Bridge fires them from ``train()`` and ``evaluate_and_print_results()``):

* ``on_train_start`` (has ``optimizer``): build the engine, repair bucket offsets (A), log a summary.
  With ``PluginOptions(enabled=False)`` no engine is built and every hook returns at once.
* ``on_train_step_start`` (has ``optimizer``): reset what a forced sync without a callback left
  behind (checkpoint save, weight-hash check) so this step gathers (C). A flag check otherwise.
  The first one after a resume (``on_train_start`` saw a loaded step) re-derives the params from
  the loaded main params if the loop runs that step with the pre-hooks off (F, :mod:`.resume`).
* ``on_train_step_end``: when the loop will force a param sync before the next step (eval,
  periodic or non-persistent save, exit interval, last iteration), stage the fresh main params
  now, so that the framework's own forced all-gather collects weights, not gradients, and no
  second gather is needed (B). Saves the config cannot schedule (SIGTERM with
  ``exit_signal_handler``, the ``exit_duration_in_mins`` deadline) are voted on: only when one of
  those knobs is on, one 1-element all-reduce per step (the loop itself runs one per knob) makes
  every rank agree that an exit save may follow, and they are handled like a scheduled save.
* ``on_eval_start`` / ``on_test_start`` (no optimizer in the context: we kept it): make the
  weights the eval reads equal the main params, gathering only if the framework's gather was
  not fresh (B).
* ``on_eval_end`` / ``on_test_end``, ``on_checkpoint_save`` (Bridge >= 0.5; its ``model`` is the
  unwrapped modules, mapped back to the engine's DDP chunks): restore the state the next training
  step needs (C); re-stage so that a save in the same iteration gathers weights.
* Where the loop stages before every forced sync itself (Bridge >= 0.6 on core >= 0.19, decided
  at ``on_train_start``), every hook leaves the weights to it: no collective, staging or write.
* ``on_train_end``: the loop's final forced sync leaves stale weights on core < 0.18; refresh
  them so what is exported or tested after ``train()`` is the trained model.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..engine.sync import ParamSyncEngine
from ..errors import MXFP8UsageError
from ..options import PluginOptions
from .session import Session, SessionFace, bridge_resumed

if TYPE_CHECKING:  # pragma: no cover
    pass

__all__ = ["MXFP8ParamSyncCallback"]

#: Stage on every step that ends within this many seconds (or three of the longest steps seen, if
#: more) of ``exit_duration_in_mins``: the loop's decision is an all-reduce over the ranks' own
#: clocks, so each rank stages a little early rather than risk one rank missing the last step.
EXIT_DURATION_MARGIN_S = 120.0


class MXFP8ParamSyncCallback(SessionFace):
    """Keeps MXFP8 params correct around eval, test and checkpoint saves in Megatron-Bridge.

    Args:
        options: a :class:`~mbridge_mxfp8_plugin.PluginOptions` (e.g. a recipe's ``mxfp8_plugin:``
            section). Every option applies here but the Lightning-only ``stage_for_nemo_steps``.
        overrides: single options by name (``validate=False``), winning over ``options``.
    """

    framework = "Bridge"

    def __init__(self, options: PluginOptions | None = None, **overrides: Any) -> None:
        self.session = Session(self.framework, type(self).__name__, options, overrides)
        #: Bridge >= 0.5 fires on_checkpoint_save after each save (and we re-stage there)
        self._save_seen = False
        self._last_step_end: float | None = None
        self._longest_step_s = 0.0

    # ------------------------------------------------------------------ plumbing
    def _engine(self, context: Any) -> ParamSyncEngine | None:
        if self.session.disabled():
            return None
        optimizer = getattr(context, "optimizer", None)
        if self.engine is not None and _wraps(self.engine.model_chunks, context.model):
            # Bridge's save_checkpoint fires on_checkpoint_save with unwrap_model(model): the same
            # job, not new chunks. Rebinding would drop the engine (and what it knows: passive,
            # fresh, staged) and take the job for one without megatron-core DDP.
            self.engine.bind_optimizer(optimizer)
            return self.engine
        return self.session.bind(context.model, optimizer)

    @staticmethod
    def _forced_syncs_ahead(context: Any, exit_expected: bool = False) -> set[str]:
        """Forced param syncs Bridge's loop will issue before the next train step ("eval", "save",
        "end"), predicted from the config the loop reads, identically on every rank (train.py
        order: the step counter is incremented after on_train_step_end, then eval, then
        ``checkpoint_and_decide_exit``: regular save, elif non-persistent save, exit interval).
        ``exit_expected``: the ranks voted that a SIGTERM / time-limit exit may follow."""
        state = getattr(context, "state", None)
        cfg = getattr(state, "cfg", None)
        train_state = getattr(state, "train_state", None)
        if cfg is None or train_state is None:
            return set()
        nxt = int(train_state.step) + 1
        train = cfg.train
        ahead: set[str] = set()
        # Bridge >= 0.4 reads the interval from cfg.validation, 0.3 from cfg.train.
        validation = getattr(cfg, "validation", None)
        eval_interval = getattr(validation, "eval_interval", None) or getattr(train, "eval_interval", None)
        if getattr(train_state, "do_valid", False) and eval_interval and nxt % eval_interval == 0:
            ahead.add("eval")
        ckpt = getattr(cfg, "checkpoint", None)
        saving = bool(getattr(ckpt, "save", None))
        save_interval = getattr(ckpt, "save_interval", None)
        non_persistent = getattr(ckpt, "non_persistent_save_interval", None)
        if saving and save_interval and nxt % save_interval == 0:
            ahead.add("save")
        elif saving and non_persistent and nxt % non_persistent == 0:
            ahead.add("save")
        exit_interval = getattr(train, "exit_interval", None)
        exit_now = bool(exit_interval and nxt % exit_interval == 0)
        last = nxt >= int(getattr(train, "train_iters", 0) or 0)
        if exit_now or exit_expected or last:
            ahead.add("end")
        # Every exit saves when saving is on (unless this step already saved); Bridge >= 0.4 also
        # saves after the last step inside train() unless save_interval == 0 (0.3 saves after
        # train() with no forced sync: one gather too many there).
        if saving and (exit_now or exit_expected or (last and save_interval != 0)):
            ahead.add("save")
        return ahead

    @staticmethod
    def _exit_watched(context: Any) -> bool:
        train = getattr(getattr(getattr(context, "state", None), "cfg", None), "train", None)
        signal = getattr(train, "exit_signal_handler", False)
        return bool(signal or getattr(train, "exit_duration_in_mins", None))

    def _exit_vote(self, context: Any) -> bool:
        """Whether any rank expects the loop to save and exit after this step. The loop decides
        with its own collective later; deciding per rank here could make one rank gather while
        another does not (a hang), so the ranks agree first."""
        flag = torch.tensor(
            [int(self._exit_near_locally(context))],
            dtype=torch.int32,
            device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu",
        )
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _exit_near_locally(self, context: Any) -> bool:
        """A SIGTERM this rank has seen, or the ``exit_duration_in_mins`` deadline close."""
        state = getattr(context, "state", None)
        train = getattr(getattr(state, "cfg", None), "train", None)
        if train is None:
            return False
        if getattr(train, "exit_signal_handler", False):
            handler = getattr(state, "_signal_handler", None)  # not the property: it builds one
            if getattr(handler, "_signal_received", False):
                return True
        minutes = getattr(train, "exit_duration_in_mins", None)
        start = getattr(state, "start_time", None)
        if minutes and isinstance(start, (int, float)):
            margin = max(EXIT_DURATION_MARGIN_S, 3.0 * self._longest_step_s)
            return time.time() - start >= 60.0 * float(minutes) - margin
        return False

    def _note_step_time(self) -> None:
        now = time.monotonic()
        if self._last_step_end is not None:
            self._longest_step_s = max(self._longest_step_s, now - self._last_step_end)
        self._last_step_end = now

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, context: Any) -> None:
        self.session.model_key = None
        self._last_step_end, self._longest_step_s = None, 0.0
        engine = self._engine(context)
        if engine is not None:
            self.session.check_job(engine, getattr(getattr(context, "state", None), "cfg", None))
            # Bridge >= 0.6 with core >= 0.19 stages before every forced sync and core does the
            # rest: the engine is then passive (and trusts the loop's gathers when judging evals).
            engine.loop_stages_itself()
        optimizer = getattr(context, "optimizer", None)
        resumed = bridge_resumed(context)
        if resumed and engine is not None:
            self.session.loaded()  # F: re-derived at the first step start unless the loop keeps pre-hooks on
        self.session.verify("checkpoint load", context.model, optimizer, when=resumed)
        self.session.prepare_verify()

    def on_train_step_start(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        self.session.step_started(engine, "on_train_step_start")

    def on_train_step_end(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None or not engine.overlap or engine.passive or not self.options.prestage:
            return
        exit_expected = False
        watched = self.options.guard_exit_saves and self._exit_watched(context)
        if watched and torch.distributed.is_initialized():
            self._note_step_time()
            exit_expected = self._exit_vote(context)
        ahead = self._forced_syncs_ahead(context, exit_expected)
        if ahead:
            # No callback fires between here and the loop's forced sync (nor before a save).
            self.session.record("on_train_step_end", engine.before_forced_sync(save="save" in ahead))

    def _before_eval(self, context: Any, event: str) -> None:
        engine = self._engine(context)
        if engine is not None:
            # The engine judges whether the loop's forced gather collected what it staged.
            self.session.eval_starts(engine, event, gathered_fresh=None)
        self.session.verify(event, context.model)

    def _after_eval(self, context: Any, event: str) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        # Re-stages for a save in the same iteration, unless the loop stages itself.
        self.session.record(event, engine.after_forced_sync())

    def on_eval_start(self, context: Any) -> None:
        self._before_eval(context, "on_eval_start")

    def on_test_start(self, context: Any) -> None:
        self._before_eval(context, "on_test_start")

    def on_eval_end(self, context: Any) -> None:
        self._after_eval(context, "on_eval_end")

    def on_test_end(self, context: Any) -> None:
        self._after_eval(context, "on_test_end")

    def on_checkpoint_save(self, context: Any) -> None:
        self.session.verify("on_checkpoint_save", context.model)
        engine = self._engine(context)
        if engine is None:
            return
        self._save_seen = True
        # Like after an eval: core >= 0.18 wrote the save's gather back and re-zeroed the buffer,
        # so re-stage for a forced sync that may follow without a callback (the closing disable
        # right after the end-of-training save, Bridge 0.5 train.py L742/L762).
        self.session.record("on_checkpoint_save", engine.after_forced_sync())

    def on_train_end(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None or not self.options.refresh_at_train_end or engine.optimizer is None:
            return
        cfg = getattr(getattr(context, "state", None), "cfg", None)
        if not self._save_seen and getattr(getattr(cfg, "checkpoint", None), "save", None):
            # Bridge < 0.5 saves right before its closing disable (interval save at the last step,
            # 0.4's end-of-training save) and fires no callback for it.
            engine.forced_sync_unobserved()
        self.session.record("on_train_end", engine.training_ended(gathered_fresh=None))
        self.session.verify("on_train_end", context.model)

    # Lightning-style conventions: nothing here must survive a resume.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise MXFP8UsageError(f"MXFP8ParamSyncCallback keeps no state; got keys {sorted(state)}")


def _wraps(chunks: list[Any], modules: Any) -> bool:
    """``modules`` are ``chunks`` with their wrappers (DDP, Float16Module) taken off, one for one."""
    modules = list(modules or [])
    if len(modules) != len(chunks) or all(m is c for m, c in zip(modules, chunks, strict=True)):
        return False
    for chunk, module in zip(chunks, modules, strict=True):
        inner = chunk
        while inner is not module and hasattr(inner, "module"):
            inner = inner.module
        if inner is not module:
            return False
    return True
