"""Megatron-Bridge adapter: :class:`MXFP8ParamSyncCallback` for ``pretrain(..., callbacks=[...])``.

Duck-typed against ``megatron.bridge.training.callbacks.Callback`` (``CallbackManager.add`` keys
on method names), so importing this module never imports Megatron-Bridge.

What each hook reads and does (Bridge fires them from ``train()`` and ``evaluate_and_print_results()``):

* ``on_train_start`` (has ``optimizer``): build the engine, repair bucket offsets (A), log a summary.
* ``on_train_step_start`` (has ``optimizer``): reset what a forced sync without a callback left
  behind (checkpoint save, weight-hash check) so this step gathers (C). A flag check otherwise.
* ``on_train_step_end``: when the loop will force a param sync before the next step (eval,
  periodic save, last iteration), stage the fresh main params now, so that the framework's own
  forced all-gather collects weights, not gradients, and no second gather is needed (B).
* ``on_eval_start`` / ``on_test_start`` (no optimizer in the context: we kept it): make the
  weights the eval reads equal the main params, gathering only if the framework's gather was
  not fresh (B).
* ``on_eval_end`` / ``on_test_end``, ``on_checkpoint_save`` (Bridge >= 0.5): restore the state the
  next training step needs (C); re-stage so that a save in the same iteration gathers weights.
* ``on_train_end``: the loop's final forced sync leaves stale weights on core < 0.18; refresh
  them so what is exported or tested after ``train()`` is the trained model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ._adapter import bind_engine, check_job
from ._log import log_rank_zero
from .errors import MXFP8UsageError
from .sync import ParamSyncEngine, SyncStats, distributed_optimizers
from .upstream import probe_live_bridge_loop

__all__ = ["MXFP8ParamSyncCallback"]


class MXFP8ParamSyncCallback:
    """Keeps MXFP8 params correct around eval, test and checkpoint saves in Megatron-Bridge.

    Args:
        repair_alignment: rewrite wrong bucket offsets (defect A) at train start. With ``False``
            a wrong offset raises instead.
        prestage: stage main params at ``on_train_step_end`` ahead of a forced sync the loop is
            about to issue, so the framework's gather is the only one. ``False`` gathers again
            in ``on_eval_start`` (always correct, one extra all-gather per eval).
        refresh_at_train_end: make the weights current after the training loop.
        validate: check the config (Bridge's ``ConfigContainer``, else the live megatron-core
            configs) at train start with :func:`mbridge_mxfp8_plugin.validate.validate_config`.
        strict: raise :class:`~mbridge_mxfp8_plugin.MXFP8ConfigError` on rule errors (else log them).
    """

    def __init__(
        self,
        *,
        repair_alignment: bool = True,
        prestage: bool = True,
        refresh_at_train_end: bool = True,
        validate: bool = True,
        strict: bool = True,
    ) -> None:
        self.repair_alignment = repair_alignment
        self.validate = validate
        self.strict = strict
        self.prestage = prestage
        self.refresh_at_train_end = refresh_at_train_end
        self.engine: ParamSyncEngine | None = None
        self._model_key: tuple[int, ...] | None = None
        self._inactive_reason: str | None = None
        self._staged_for_sync = False
        #: the running Bridge loop stages main params before every forced sync itself (>= 0.6)
        self._loop_stages = False
        #: Bridge >= 0.5 fires on_checkpoint_save after each save (and we re-stage there)
        self._save_seen = False
        self.last_stats: SyncStats | None = None
        self.history: list[tuple[str, SyncStats]] = []

    # ------------------------------------------------------------------ plumbing
    def _engine(self, context: Any) -> ParamSyncEngine | None:
        model: Sequence[Any] = context.model
        key = tuple(id(m) for m in model)
        if key == self._model_key:
            if self.engine is not None and getattr(context, "optimizer", None) is not None:
                self.engine.optimizer = context.optimizer
            return self.engine
        self._model_key = key
        self.engine, self._inactive_reason = bind_engine(
            model,
            getattr(context, "optimizer", None),
            repair_alignment=self.repair_alignment,
            framework="Bridge",
        )
        return self.engine

    def _record(self, event: str, stats: SyncStats) -> None:
        self.last_stats = stats
        self.history.append((event, stats))

    @staticmethod
    def _forced_syncs_ahead(context: Any) -> set[str]:
        """Forced param syncs Bridge's loop will issue before the next train step ("eval", "save",
        "end"), predicted from the config the loop reads (train.py order: the step counter is
        incremented after on_train_step_end, then eval, then checkpoint_and_decide_exit)."""
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
        save_interval = getattr(ckpt, "save_interval", None)
        if getattr(ckpt, "save", None) and save_interval and nxt % save_interval == 0:
            ahead.add("save")
        exit_interval = getattr(train, "exit_interval", None)
        if nxt >= int(getattr(train, "train_iters", 0) or 0) or (exit_interval and nxt % exit_interval == 0):
            ahead.add("end")
        return ahead

    def _synced_by_framework(self, engine: ParamSyncEngine) -> bool:
        return engine.synced_without_gather_in_flight()

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, context: Any) -> None:
        self._model_key = None
        engine = self._engine(context)
        if engine is not None:
            self._check_job(engine, context)
        self._loop_stages = engine is not None and self._loop_stages_itself(engine)

    def _check_job(self, engine: ParamSyncEngine, context: Any) -> None:
        check_job(
            engine,
            container=getattr(getattr(context, "state", None), "cfg", None),
            plugin={"enabled": True, "repair_alignment": self.repair_alignment, "strict": self.strict},
            validate=self.validate,
            strict=self.strict,
            owner="MXFP8ParamSyncCallback",
        )

    @staticmethod
    def _loop_stages_itself(engine: ParamSyncEngine) -> bool:
        """Bridge >= 0.6 with core >= 0.19: every forced sync is preceded by the optimizer's
        ``prepare_model_params_for_param_sync()`` (evals, saves, hash checks, the closing disable),
        core writes the gather back (B1) and resets the dispatch state (C). Staging again would
        only rewrite the buffer, so the callback stays passive."""
        beh = engine.behaviour
        if not (beh.has_prepare_for_param_sync and beh.forced_sync_writes_back and beh.has_dispatch_reset):
            return False
        if not probe_live_bridge_loop():
            return False
        # prepare_model_params_for_param_sync() only stages when the *optimizer* config has both
        # knobs (DistributedOptimizer.prepare_model_params_for_param_sync, core 0.19).
        opts = distributed_optimizers(engine.optimizer) if engine.optimizer is not None else []
        return bool(opts) and all(
            getattr(o.config, "reuse_grad_buf_for_mxfp8_param_ag", False)
            and getattr(o.config, "overlap_param_gather", False)
            for o in opts
        )

    def on_train_step_start(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        self._staged_for_sync = False
        engine.note_training_step()
        stats = engine.restore_for_training()
        if stats.groups_reset:
            self._record("on_train_step_start", stats)

    def on_train_step_end(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None or not engine.overlap:
            return
        if self._loop_stages:
            self._staged_for_sync = True  # the loop stages before its forced sync (Bridge >= 0.6)
            return
        if not self.prestage:
            return
        ahead = self._forced_syncs_ahead(context)
        if "save" in ahead and not engine.behaviour.forced_sync_writes_back:
            # Core < 0.18 never writes a forced gather back and no callback fires before a save:
            # write the weights now and leave the gathered buffer for the save's own gather.
            self._record("on_train_step_end", engine.refresh_weights(keep_gathered=True))
        elif ahead:
            self._staged_for_sync = engine.stage_main_params()

    def _before_eval(self, context: Any, event: str) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        if engine.optimizer is None:
            log_rank_zero(
                logging.INFO,
                "MXFP8 param-sync plugin: %s without an optimizer; keeping weights as loaded.",
                event,
            )
        fresh = self._staged_for_sync and self._synced_by_framework(engine)
        self._record(event, engine.weights_for_eval(gathered_fresh=fresh))
        self._staged_for_sync = False

    def _after_eval(self, context: Any, event: str) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        if self._loop_stages:
            stats = engine.restore_for_training()  # no re-staging: the loop stages before a save
            self._staged_for_sync = True
        else:
            stats = engine.back_to_training()
            self._staged_for_sync = stats.staged
        self._record(event, stats)

    def on_eval_start(self, context: Any) -> None:
        self._before_eval(context, "on_eval_start")

    def on_test_start(self, context: Any) -> None:
        self._before_eval(context, "on_test_start")

    def on_eval_end(self, context: Any) -> None:
        self._after_eval(context, "on_eval_end")

    def on_test_end(self, context: Any) -> None:
        self._after_eval(context, "on_test_end")

    def on_checkpoint_save(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None:
            return
        self._save_seen = True
        if self._loop_stages:
            stats = engine.restore_for_training()
        else:
            # Like after an eval: core >= 0.18 wrote the save's gather back and re-zeroed the
            # buffer, so re-stage for a forced sync that may follow without a callback (the
            # closing disable right after the end-of-training save, Bridge 0.5 train.py L742/L762).
            stats = engine.back_to_training()
            self._staged_for_sync = stats.staged
        self._record("on_checkpoint_save", stats)

    def on_train_end(self, context: Any) -> None:
        engine = self._engine(context)
        if engine is None or not self.refresh_at_train_end or engine.optimizer is None:
            return
        fresh = self._staged_for_sync and self._synced_by_framework(engine)
        if fresh and self._unseen_save_possible(engine, context):
            # Bridge < 0.5 saves right before its closing disable (interval save at the last step,
            # 0.4's end-of-training save) with no callback in between: on core >= 0.18 that save's
            # gather consumed and re-zeroed the staged buffer, so the closing gather wrote zeros.
            fresh = False
        self._record("on_train_end", engine.refresh_weights(gathered_fresh=fresh))
        self._staged_for_sync = False

    def _unseen_save_possible(self, engine: ParamSyncEngine, context: Any) -> bool:
        if self._loop_stages or self._save_seen or not engine.behaviour.forced_sync_writes_back:
            return False  # the loop stages / on_checkpoint_save re-staged / repeated gathers are idempotent
        cfg = getattr(getattr(context, "state", None), "cfg", None)
        return bool(getattr(getattr(cfg, "checkpoint", None), "save", None))

    # Lightning-style conventions: nothing here must survive a resume.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise MXFP8UsageError(f"MXFP8ParamSyncCallback keeps no state; got keys {sorted(state)}")
