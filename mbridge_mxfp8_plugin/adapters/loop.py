"""The loop-agnostic API: the calls a training loop with no callback system adds where it syncs.

Megatron-LM's own ``megatron/training/training.py`` (what ``pretrain_gpt.py`` runs) has no
callbacks, so the fixes are called where the loop forces its param syncs. The lines to add, for
Megatron-LM at tag ``core_v0.16.1`` (the loop of megatron-core 0.16.1; ``Lnnnn`` are line numbers
of that file)::

    from mbridge_mxfp8_plugin import PluginOptions, mxfp8_param_sync

    # train(), after the initial pre-hook disable (L2657-2663), before `while iteration < ...` (L2684):
    sync = mxfp8_param_sync(model, optimizer, PluginOptions())   # options: optional
    if iteration > 0:          # resumed from a checkpoint (args.iteration after load_checkpoint)
        sync.after_load()

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
``save_checkpoint_and_time`` needs no new argument (asking again with different options raises
:class:`~mbridge_mxfp8_plugin.MXFP8UsageError`). It can also be used as a context manager
(``with mxfp8_param_sync(model, optimizer) as sync:``), which calls :meth:`MXFP8ParamSync.close`
on exit.

Cost: ``step_started`` is a flag check per bucket group. On megatron-core < 0.19 ``before_eval``
issues one all-gather of the params (the loop's own forced gather collected gradients; the
Bridge callback avoids it because Bridge tells it in advance that an eval follows), and on core
< 0.18 ``before_save`` issues one (core writes no forced gather back). After ``after_load``, the
first ``step_started`` issues one where that step runs with the pre-hooks off, as Megatron-LM's
``train()`` does (F; none where the checkpoint loader re-derives the params itself, Megatron-LM
main #6666). With Megatron-LM core_v0.19 and megatron-core >= 0.19, which fixed A-C upstream,
every other call does nothing.
When the job does not use MXFP8 params with ``reuse_grad_buf_for_mxfp8_param_ag`` and the
distributed optimizer, or ``PluginOptions(enabled=False)``, the object is inert: one rank-zero
log line, then no work.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..engine.sync import ParamSyncEngine, SyncStats
from ..errors import MXFP8UsageError
from ..options import PluginOptions
from ..probes import probe_core
from .session import Session, SessionFace

if TYPE_CHECKING:  # pragma: no cover
    from ..verify import WeightReport

__all__ = ["MXFP8ParamSync", "mxfp8_param_sync"]


class MXFP8ParamSync(SessionFace):
    """Keeps MXFP8 params correct around the forced param syncs of a hand-written training loop.

    Build it with :func:`mxfp8_param_sync`. Every method is safe to call on every rank at the
    same point of the loop (they may issue collectives) and returns the engine's
    :class:`~mbridge_mxfp8_plugin.SyncStats` for logging. Reads ``enabled``, ``repair_alignment``,
    ``validate``, ``strict``, ``refresh_at_train_end`` and ``verify_weights`` of its options (the
    others name events this loop does not announce).
    """

    framework = "loop API"

    def __init__(self, model_chunks: Sequence[Any], optimizer: Any, options: PluginOptions) -> None:
        self.session = Session(self.framework, type(self).__name__, options)
        self.model_chunks = _as_chunks(model_chunks)
        self._stepped = False
        self.session.remember(self.model_chunks, optimizer)
        if self.session.disabled():
            self.session.prepare_verify()  # the check runs with enabled=False too
            return
        engine = self.session.bind(self.model_chunks, optimizer)
        if engine is not None:
            self.session.check_job(engine)
            # Megatron-LM core_v0.19 with megatron-core >= 0.19 stages before every forced sync
            # itself: every call is then a no-op (engine.passive).
            engine.loop_stages_itself()
        self.session.prepare_verify()

    def _working(self) -> ParamSyncEngine | None:
        """The engine when there is work for it: not when inactive or the loop stages itself."""
        return None if self.engine is None or self.engine.passive else self.engine

    def _idle(self) -> SyncStats:
        return SyncStats(note="inactive" if self.engine is None else "loop stages itself")

    def step_started(self) -> SyncStats:
        """A training step begins: undo what a forced sync (eval, save, weight-hash check) left
        behind, so this step gathers the fresh weights instead of adding them to its gradients (C).
        The first one after :meth:`after_load` may gather once more (F); its history says so."""
        self._stepped = True
        if self.engine is None:
            return self._idle()
        stats = self.engine.step_started()
        self.session.first_step_after_load(self.engine)
        return stats

    def after_load(self) -> SyncStats:
        """A checkpoint was loaded into the model and the optimizer and no step has run since: the
        next :meth:`step_started` re-derives the params from the loaded fp32 main params, where that
        step runs with the pre-hooks off, so the resumed run computes what the uninterrupted one
        would have (F). Call before the first :meth:`step_started`; issues no collective."""
        if self.engine is None:
            return self._idle()
        self.session.loaded()
        return SyncStats(note="resume: params re-derived at the next step start where needed")

    def before_eval(self) -> SyncStats:
        """Eval is about to read the weights (the loop's forced sync has run): make them the
        current fp32 main params, rounded to MXFP8, at the padded offsets (A, B)."""
        engine = self._working()
        stats = engine.before_eval() if engine is not None else self._idle()
        self.session.verify("eval")
        return stats

    def after_eval(self) -> SyncStats:
        """Eval is over and the pre-hooks are back: the next step must gather again (C)."""
        engine = self._working()
        # before_save() prepares every save, so nothing is staged here for one.
        return engine.after_forced_sync(restage=False) if engine is not None else self._idle()

    def before_save(self) -> SyncStats:
        """A checkpoint save will force a param sync and read the weights: stage the main params
        so that sync collects them (core >= 0.18 writes it back), or write them now (core < 0.18)."""
        engine = self._working()
        if engine is None or not self._stepped:
            # Before any step the weights are exactly as initialised or loaded.
            stats = SyncStats(note="nothing to prepare")
        else:
            stats = engine.before_forced_sync(save=True)
        if not self._stepped or not probe_core().forced_sync_writes_back:
            # What the save writes is final here only where core does not write the save's gather
            # back (< 0.18: refreshed above, or stale without the plugin) or nothing stepped; on
            # >= 0.18 that gather makes the weights current after this call, unobserved.
            self.session.verify("save")
        return stats

    def close(self) -> SyncStats:
        """Training is over (after the loop's closing forced sync): make the weights current for
        whatever reads them next (export, a final eval, an eval-only tool)."""
        engine = self._working()
        if engine is None or not self._stepped or not self.options.refresh_at_train_end:
            stats = SyncStats(note="nothing to refresh")
        else:
            stats = engine.refresh_weights(gathered_fresh=False)
        if self.options.refresh_at_train_end:
            self.session.verify("train end")
        return stats

    def verify(self, event: str = "manual") -> WeightReport:
        """Check the weights now, on every rank at the same point (one small all-reduce per
        data-parallel group): the owned params against their quantized fp32 main shards, and the
        replicas against each other. Call it where the weights must be current, e.g. right after
        a checkpoint load (``event="checkpoint load"``); with ``verify_weights`` on,
        :meth:`before_eval`, :meth:`before_save` (core < 0.18) and :meth:`close` call it
        themselves. Runs whatever the option says and obeys ``strict`` like they do: a mismatch
        raises :class:`~mbridge_mxfp8_plugin.MXFP8PluginError`, or is logged at ERROR.
        """
        report = self.session.verify(event, force=True)
        if report is None:
            raise MXFP8UsageError(
                "verify() needs megatron-core DDP model chunks and an optimizer holding a "
                "DistributedOptimizer (mxfp8_param_sync(model, optimizer))"
            )
        return report

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


def _as_chunks(model_chunks: Sequence[Any] | Any) -> list[Any]:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


_SESSIONS: weakref.WeakValueDictionary[tuple[int, ...], MXFP8ParamSync] = weakref.WeakValueDictionary()


def mxfp8_param_sync(
    model_chunks: Sequence[Any] | Any,
    optimizer: Any,
    options: PluginOptions | None = None,
    **overrides: Any,
) -> MXFP8ParamSync:
    """The param-sync fixes for these megatron-core DDP model chunks, for a loop without callbacks.

    Returns the live :class:`MXFP8ParamSync` of these chunks if one exists (so a function deep in
    the loop, such as ``save_checkpoint_and_time``, gets the same object from ``model`` and
    ``optimizer``), else builds one: probes megatron-core, repairs the bucket offsets (defect A)
    and checks the job's configs. ``options`` is the :class:`~mbridge_mxfp8_plugin.PluginOptions`
    every entry point shares; keyword ``overrides`` (``strict=False``, ...) win over it. Asking
    again with options or overrides that differ from the live object's raises
    :class:`~mbridge_mxfp8_plugin.MXFP8UsageError`; asking with neither returns it as it is.
    The module docstring shows where each call goes in Megatron-LM's ``training.py``.
    """
    chunks = _as_chunks(model_chunks)
    key = ParamSyncEngine.model_key(chunks)
    session = _SESSIONS.get(key)
    if session is not None and all(a is b for a, b in zip(session.model_chunks, chunks, strict=True)):
        asked = (options or session.options).replace(**overrides)
        if asked != session.options:
            raise MXFP8UsageError(
                f"mxfp8_param_sync was already set up for these model chunks with {session.options}; "
                f"asked again with {asked}. Pass the same options (or none) on every call"
            )
        if session.engine is not None:
            session.engine.bind_optimizer(optimizer)
        session.session.remember(None, optimizer)
        return session
    session = MXFP8ParamSync(chunks, optimizer, (options or PluginOptions()).replace(**overrides))
    _SESSIONS[key] = session
    return session
