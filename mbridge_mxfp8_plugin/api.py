"""The loop-agnostic API: four calls for any training loop that has no callback system.

Megatron-LM's own ``megatron/training/training.py`` (what ``pretrain_gpt.py`` runs) has no
callbacks, so the fixes are called where the loop forces its param syncs. The lines to add, for
Megatron-LM at tag ``core_v0.16.1`` (the loop of megatron-core 0.16.1; ``Lnnnn`` are line numbers
of that file)::

    from mbridge_mxfp8_plugin import mxfp8_param_sync

    # train(), after the initial pre-hook disable (L2657-2663), before `while iteration < ...` (L2684):
    sync = mxfp8_param_sync(model, optimizer)

    # train(), in the loop, after `ft_integration.on_training_step_start()` (L2785), i.e. right
    # before the `train_step(...)` call (L2786-2797):
    sync.step_started()

    # train(), evaluation block: after `disable_forward_pre_hook(model)` (L2918-2920) and before
    # `evaluate_and_print_results(...)` (L2945):
    sync.before_eval()
    # ... and after `enable_forward_pre_hook(model)` (L2959-2961):
    sync.after_eval()

    # save_checkpoint_and_time(), right before `force_param_sync(model)` (L2192-2193):
    mxfp8_param_sync(model, optimizer).before_save()    # the same object as `sync` above

    # train(), after the closing `disable_forward_pre_hook(model)` (L3006-3007):
    sync.close()

``mxfp8_param_sync(model, optimizer)`` returns the same object for the same model chunks, so
``save_checkpoint_and_time`` needs no new argument. It can also be used as a context manager
(``with mxfp8_param_sync(model, optimizer) as sync:``), which calls :meth:`MXFP8ParamSync.close`
on exit.

Cost: ``step_started`` is a flag check per bucket group. On megatron-core < 0.19 ``before_eval``
issues one all-gather of the params (the loop's own forced gather collected gradients; the
Bridge callback avoids it because Bridge tells it in advance that an eval follows), and on core
< 0.18 ``before_save`` issues one (core writes no forced gather back). With Megatron-LM
core_v0.19 and megatron-core >= 0.19, which fixed all of it upstream, every call does nothing.
When the job does not use MXFP8 params with ``reuse_grad_buf_for_mxfp8_param_ag`` and the
distributed optimizer, the object is inert: one rank-zero log line, then no work.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ._adapter import bind_engine, check_job
from .options import PluginOptions
from .sync import ParamSyncEngine, SyncStats

__all__ = ["MXFP8ParamSync", "mxfp8_param_sync"]


class MXFP8ParamSync:
    """Keeps MXFP8 params correct around the forced param syncs of a hand-written training loop.

    Build it with :func:`mxfp8_param_sync`. Every method is safe to call on every rank at the
    same point of the loop (they may issue collectives) and returns the engine's
    :class:`~mbridge_mxfp8_plugin.SyncStats` for logging.
    """

    def __init__(self, model_chunks: Sequence[Any], optimizer: Any, options: PluginOptions) -> None:
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.model_chunks = chunks
        self.options = options
        self.engine: ParamSyncEngine | None
        self.engine, self.inactive_reason = bind_engine(
            chunks, optimizer, repair_alignment=options.repair_alignment, framework="loop API"
        )
        #: the loop stages main params before every forced sync itself (Megatron-LM core_v0.19
        #: with megatron-core >= 0.19): every call is a no-op.
        self.passive = False
        self._stepped = False
        if self.engine is not None:
            check_job(
                self.engine,
                container=None,
                plugin={
                    "enabled": True,
                    "repair_alignment": options.repair_alignment,
                    "strict": options.strict,
                },
                validate=options.validate,
                strict=options.strict,
                owner="mxfp8_param_sync",
            )
            self.passive = self.engine.loop_stages_itself()

    def _idle(self) -> bool:
        return self.engine is None or self.passive

    def step_started(self) -> SyncStats:
        """A training step begins: undo what a forced sync (eval, save, weight-hash check) left
        behind, so this step gathers the fresh weights instead of adding them to its gradients (C)."""
        if self.engine is None:
            return SyncStats(note="inactive")
        self._stepped = True
        return self.engine.step_started()

    def before_eval(self) -> SyncStats:
        """Eval is about to read the weights (the loop's forced sync has run): make them the
        current fp32 main params, rounded to MXFP8, at the padded offsets (A, B)."""
        if self._idle():
            return SyncStats(note="inactive" if self.engine is None else "loop stages itself")
        assert self.engine is not None
        return self.engine.before_eval()

    def after_eval(self) -> SyncStats:
        """Eval is over and the pre-hooks are back: the next step must gather again (C)."""
        if self._idle():
            return SyncStats(note="inactive" if self.engine is None else "loop stages itself")
        assert self.engine is not None
        # before_save() prepares every save, so nothing is staged here for one.
        return self.engine.after_forced_sync(restage=False)

    def before_save(self) -> SyncStats:
        """A checkpoint save will force a param sync and read the weights: stage the main params
        so that sync collects them (core >= 0.18 writes it back), or write them now (core < 0.18)."""
        if self._idle() or not self._stepped:
            # Before any step the weights are exactly as initialised or loaded.
            return SyncStats(note="nothing to prepare")
        assert self.engine is not None
        return self.engine.before_forced_sync(save=True)

    def close(self) -> SyncStats:
        """Training is over (after the loop's closing forced sync): make the weights current for
        whatever reads them next (export, a final eval, an eval-only tool)."""
        if self._idle() or not self._stepped:
            return SyncStats(note="nothing to refresh")
        assert self.engine is not None
        return self.engine.refresh_weights()

    def __enter__(self) -> MXFP8ParamSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # After an exception the ranks may be out of step; a refresh issues collectives.
        if exc_type is None:
            self.close()


_SESSIONS: weakref.WeakValueDictionary[tuple[int, ...], MXFP8ParamSync] = weakref.WeakValueDictionary()


def mxfp8_param_sync(
    model_chunks: Sequence[Any] | Any,
    optimizer: Any,
    options: PluginOptions | None = None,
    *,
    repair_alignment: bool | None = None,
    validate: bool | None = None,
    strict: bool | None = None,
) -> MXFP8ParamSync:
    """The param-sync fixes for these megatron-core DDP model chunks, for a loop without callbacks.

    Returns the live :class:`MXFP8ParamSync` of these chunks if one exists (so a function deep in
    the loop, such as ``save_checkpoint_and_time``, gets the same object from ``model`` and
    ``optimizer``), else builds one: probes megatron-core, repairs the bucket offsets (defect A;
    ``repair_alignment=False`` raises on a wrong offset instead) and checks the job's configs
    (``validate``; ``strict=True`` raises :class:`~mbridge_mxfp8_plugin.MXFP8ConfigError`).
    ``options`` is the :class:`~mbridge_mxfp8_plugin.PluginOptions` every entry point shares (a
    recipe's ``mxfp8_plugin:`` section); a keyword given here wins over it.
    The module docstring shows where each call goes in Megatron-LM's ``training.py``.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    key = tuple(id(c) for c in chunks)
    session = _SESSIONS.get(key)
    if session is not None and all(a is b for a, b in zip(session.model_chunks, chunks, strict=True)):
        if session.engine is not None:
            session.engine.bind_optimizer(optimizer)
        return session
    opts = (options or PluginOptions()).replace(
        repair_alignment=repair_alignment, validate=validate, strict=strict
    )
    session = MXFP8ParamSync(chunks, optimizer, opts)
    _SESSIONS[key] = session
    return session
