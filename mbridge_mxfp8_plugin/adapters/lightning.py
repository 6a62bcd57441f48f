"""Lightning adapter: :class:`MXFP8ParamSyncLightningCallback` for ``Trainer(callbacks=[...])``.

Lightning is an optional extra; this module is the only one that imports it.

Lightning loops around megatron-core (NeMo 2's ``MegatronStrategy``, or a user's own
``LightningModule`` driving DDP chunks and a Megatron optimizer) differ from Bridge's in ways that
decide where the fixes must go:

* NeMo 2 never toggles the forward pre-hooks around validation: the first validation forward's
  pre-hook gathers whatever the shared grad/param buffer holds, i.e. the reduced gradients of the
  last step. ``on_validation_start`` therefore refreshes the weights and marks the buckets synced
  so the pre-hooks skip (B); ``on_validation_end`` undoes that so the next step gathers (C).
* NeMo 2 never stages the fp32 main params into the shared buffer before a training step
  (megatron-core leaves that to the loop when ``overlap_param_gather`` is on), so without help
  every step's pre-hook gathers the just-zeroed buffer. NeMo's ``MegatronParallel`` forwards the
  trainer's callbacks its own events; :meth:`~MXFP8ParamSyncLightningCallback.on_megatron_microbatches_start`
  fires after ``zero_grad_buffer()`` and before the first forward, the one point where staging is
  both needed and safe. Loops that stage themselves (Bridge style) are left alone.
* NeMo 2's only forced sync is ``MegatronStrategy.save_checkpoint`` -> ``force_param_sync()``,
  with no Lightning hook after it; ``on_save_checkpoint`` runs just before it and
  ``on_train_batch_start`` resets what it leaves behind (C).
* After a resume (``trainer.ckpt_path``) the first ``on_train_batch_start`` re-derives the params
  from the loaded fp32 main params where that batch runs with the pre-hooks off (F,
  :mod:`.resume`); NeMo 2 keeps them on, and the staging above makes its first forward gather them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

try:
    from lightning.pytorch import Callback
except ImportError as _exc:  # the extra is not installed
    raise ImportError(
        "mbridge_mxfp8_plugin.lightning needs Lightning: pip install 'mbridge-mxfp8-plugin[lightning]'"
    ) from _exc

from ..common.log import log_rank_zero
from ..engine.sync import ParamSyncEngine
from ..errors import MXFP8UsageError
from ..mcore.layout import distributed_optimizers
from ..options import PluginOptions
from .session import Session, SessionFace, find_model_chunks

if TYPE_CHECKING:  # pragma: no cover
    pass

__all__ = ["MXFP8ParamSyncLightningCallback", "find_megatron_optimizer", "find_model_chunks"]

ModelGetter = Callable[[Any, Any], Any]
OptimizerGetter = Callable[[Any, Any], Any]

#: Attributes that frameworks use to wrap a Megatron optimizer (NeMo: ``mcore_optimizer``;
#: Lightning's ``LightningOptimizer``: ``_optimizer``; generic wrappers: ``optimizer``).
_OPTIMIZER_WRAPPER_ATTRS = ("mcore_optimizer", "_optimizer", "optimizer")
_MAX_DEPTH = 6


def _describe(obj: Any) -> str:
    if isinstance(obj, (list, tuple)):
        names = [type(o).__name__ for o in obj[:4]] + (["..."] if len(obj) > 4 else [])
        return f"{type(obj).__name__}[{', '.join(names)}]"
    return type(obj).__name__


def find_megatron_optimizer(candidates: Iterable[Any]) -> Any | None:
    """The first candidate that is, or wraps, a Megatron optimizer holding a DistributedOptimizer.

    Returns the outermost Megatron object (usually a ``ChainedOptimizer``), since that is what
    ``get_megatron_optimizer`` hands the loop and what the engine expects.
    """
    for candidate in candidates:
        obj = candidate
        for _ in range(_MAX_DEPTH):
            if obj is None:
                break
            if distributed_optimizers(obj):
                return obj
            inner = (getattr(obj, a, None) for a in _OPTIMIZER_WRAPPER_ATTRS)
            obj = next((o for o in inner if o is not None), None)
    return None


class MXFP8ParamSyncLightningCallback(Callback, SessionFace):
    """Keeps MXFP8 params correct around validation, test and checkpoint saves in Lightning.

    Args:
        options: a :class:`~mbridge_mxfp8_plugin.PluginOptions` (e.g. a recipe's ``mxfp8_plugin:``
            section). Every option applies here but the Bridge-only ``prestage`` and
            ``guard_exit_saves``.
        model_getter: ``(trainer, pl_module) -> chunk or list of chunks`` when the megatron-core
            DDP chunks cannot be found from ``trainer.strategy.model`` / ``pl_module``.
        optimizer_getter: ``(trainer, pl_module) -> optimizer`` when the Megatron optimizer is not
            in ``trainer.optimizers`` (directly or behind ``.mcore_optimizer`` / ``.optimizer``).
        overrides: single options by name (``validate=False``), winning over ``options``.
    """

    framework = "Lightning"

    def __init__(
        self,
        options: PluginOptions | None = None,
        *,
        model_getter: ModelGetter | None = None,
        optimizer_getter: OptimizerGetter | None = None,
        **overrides: Any,
    ) -> None:
        self.model_getter = model_getter
        self.optimizer_getter = optimizer_getter
        self.session = Session(self.framework, type(self).__name__, options, overrides)
        self._stepped = False

    # ------------------------------------------------------------------ Lightning conventions
    @property
    def state_key(self) -> str:
        return self._generate_state_key(repair_alignment=self.options.repair_alignment)

    def state_dict(self) -> dict[str, Any]:
        # Everything here is derived from the live model; nothing must survive a resume.
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise MXFP8UsageError(
                f"MXFP8ParamSyncLightningCallback keeps no state; checkpoint holds keys {sorted(state_dict)}"
            )

    def __getstate__(self) -> dict[str, Any]:
        # The engine references live model chunks and process groups, which do not pickle and
        # would be wrong in another process anyway; it is rebuilt from the trainer on first use.
        state = self.__dict__.copy()
        state.pop("_stepped", None)
        state["session"] = self.session.options  # the options travel; the session is rebuilt
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = state.pop("session")
        self.__dict__.update(state)
        self.session = Session(self.framework, type(self).__name__, options)
        self._stepped = False

    # ------------------------------------------------------------------ discovery
    def _chunks(self, trainer: Any, pl_module: Any) -> tuple[list[Any], str | None]:
        """The megatron-core DDP chunks (Megatron-FSDP wrappers, which ``_bind`` leaves to FSDP
        with one log line), or ([], why the plugin does not apply). Only a ``model_getter`` that
        misses raises: the user named the chunks, so finding none is their error, not our scope."""
        if self.model_getter is not None:
            got = self.model_getter(trainer, pl_module)
            roots: list[Any] = [got]
        else:
            roots = [getattr(getattr(trainer, "strategy", None), "model", None), pl_module]
        chunks, fsdp = find_model_chunks(roots)
        if chunks:
            return chunks, None
        if fsdp:
            return fsdp, None
        where = "model_getter's result" if self.model_getter else "trainer.strategy.model and pl_module"
        seen = ", ".join(_describe(r) for r in roots if r is not None) or "nothing"
        why = (
            f"found no megatron-core DistributedDataParallel chunk in {where} (saw: {seen}); if the "
            "model has them, pass model_getter=lambda trainer, pl_module: [ddp_chunk, ...]"
        )
        if self.model_getter is not None:  # the user pointed at the chunks and missed: an error
            raise MXFP8UsageError(f"MXFP8 param-sync plugin {why}")
        return [], why

    def _optimizer(self, trainer: Any, pl_module: Any) -> Any | None:
        if self.optimizer_getter is not None:
            candidates: list[Any] = [self.optimizer_getter(trainer, pl_module)]
        else:
            candidates = list(getattr(trainer, "optimizers", None) or [])
        found = find_megatron_optimizer(candidates)
        if found is None and self.optimizer_getter is not None:
            raise MXFP8UsageError(
                f"optimizer_getter returned {_describe(candidates[0])}, which neither is nor wraps (via "
                f"{'/'.join(_OPTIMIZER_WRAPPER_ATTRS)}) a Megatron optimizer with a DistributedOptimizer"
            )
        return found

    def _engine(self, trainer: Any, pl_module: Any, *, need_optimizer: bool) -> ParamSyncEngine | None:
        """Find chunks and optimizer; (re)build the engine only when the chunks changed."""
        if self.session.disabled():
            return None
        chunks, reason = self._chunks(trainer, pl_module)
        if not chunks:
            # As Bridge's callback on a model it does not apply to: one rank-0 line, then nothing.
            if self.inactive_reason != reason:
                self.inactive_reason = reason
                log_rank_zero(logging.WARNING, "MXFP8 param-sync plugin inactive: %s.", reason)
            return None
        self.session.bind(chunks, None, reason=reason)
        if self.engine is None:
            return None
        engine = self.engine
        optimizer = self._optimizer(trainer, pl_module)
        if optimizer is not None:
            engine.bind_optimizer(optimizer)
        elif need_optimizer and engine.overlap and engine.optimizer is None:
            seen = ", ".join(_describe(o) for o in (getattr(trainer, "optimizers", None) or [])) or "none"
            raise MXFP8UsageError(
                "MXFP8 param-sync plugin found no Megatron optimizer with a DistributedOptimizer in "
                f"trainer.optimizers (saw: {seen}; looked behind .{', .'.join(_OPTIMIZER_WRAPPER_ATTRS)}); "
                "return it from configure_optimizers or pass optimizer_getter=lambda trainer, pl_module: opt"
            )
        return engine

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Strategies such as NeMo's wrap the model in DDP after the callbacks' setup, so nothing
        # can be validated yet; start from a clean slate for this stage.
        self.session.model_key = None
        self.engine = None
        self._stepped = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = self._engine(trainer, pl_module, need_optimizer=True)
        if engine is not None:
            self.session.check_job(engine)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # After Lightning restored the optimizer state too (on_fit_start comes before that).
        resumed = bool(getattr(trainer, "ckpt_path", None))
        if resumed and self.engine is not None:
            self.session.loaded()  # F: re-derived at the first batch unless its pre-hooks are on
        self.session.verify("checkpoint load", when=resumed)
        self.session.prepare_verify()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Drop references to the model so a finished Trainer does not keep it alive through us.
        self.engine = None
        self.session.model_key = None

    # ------------------------------------------------------------------ training
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self.engine
        if engine is None:
            return
        # Safety net: a checkpoint save (or any forced sync) since the last step fires no hook
        # afterwards; without this reset the step would skip its gather (C).
        self.session.step_started(engine, "on_train_batch_start")

    def on_megatron_microbatches_start(self, step: Any = None, **kwargs: Any) -> None:
        """NeMo 2 ``MegatronParallel`` event: after ``zero_grad_buffer()``, before the first forward.

        NeMo never stages the main params, so each step's pre-hook would gather the zeroed buffer.
        Staging is done only when a gather is certain to follow (pre-hooks on, nothing dispatched),
        since staged values that are not gathered and re-zeroed become gradients.
        """
        engine = self.engine
        if engine is None or not self.options.stage_for_nemo_steps or getattr(step, "forward_only", False):
            return
        if engine.stage_for_step():
            self._stepped = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.engine is None:
            return
        self._stepped = True
        # NeMo's ModelCheckpoint saves the last step weights-only, and Lightning fires no
        # on_save_checkpoint for a weights-only save: prepare it here (checkpoint callbacks run
        # after every other callback's on_train_batch_end).
        max_steps = getattr(trainer, "max_steps", -1) or -1
        saving = bool(getattr(trainer, "checkpoint_callbacks", None))
        if saving and max_steps > 0 and trainer.global_step >= max_steps:
            self._prepare_save("on_train_batch_end")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        engine = self.engine
        if engine is None or not self.options.refresh_at_train_end or engine.optimizer is None:
            return
        if self._stepped:
            self.session.record("on_train_end", engine.training_ended(gathered_fresh=False))
            self.session.verify("on_train_end")

    # ------------------------------------------------------------------ validation / test
    def _before_eval(self, trainer: Any, pl_module: Any, event: str) -> None:
        engine = self.engine
        if engine is None:
            engine = self._engine(trainer, pl_module, need_optimizer=False)
        if engine is not None:
            # Lightning loops never force a sync right before validation: no forced gather to
            # reuse. Also right for the sanity check before any step (main params = weights).
            self.session.eval_starts(engine, event, gathered_fresh=False)
        self.session.verify(event)

    def _after_eval(self, event: str) -> None:
        engine = self.engine
        if engine is None:
            return
        # ModelCheckpoint runs after us and a NeMo save forces a sync: after_forced_sync re-stages
        # where core writes forced gathers back (>= 0.18).
        self.session.record(event, engine.after_forced_sync())

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._before_eval(trainer, pl_module, "on_validation_start")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._after_eval("on_validation_end")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._before_eval(trainer, pl_module, "on_test_start")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._after_eval("on_test_end")

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Runs inside ``trainer.save_checkpoint`` just before ``strategy.save_checkpoint``.

        NeMo's strategy then forces a param sync and reads the weights: make ``param.data``
        current (core < 0.18 never writes a forced gather back) and, where core does write back,
        re-stage so that write-back gathers weights rather than the re-zeroed buffer.
        """
        self._prepare_save("on_save_checkpoint")
        self.session.verify("on_save_checkpoint")

    def _prepare_save(self, event: str) -> None:
        engine = self.engine
        if engine is None or engine.optimizer is None or not engine.overlap or not self._stepped:
            return
        self.session.record(event, engine.refresh_for_save())
