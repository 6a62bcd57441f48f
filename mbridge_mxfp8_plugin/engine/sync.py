"""The engine: make the model's weights right around forced param syncs (defects B and C).

It acts on megatron-core objects only (DDP chunks, bucket groups, distributed optimizers), and
every read or write of their param-sync state lives here (copies planned in :mod:`.plan`, offsets
in :mod:`.buckets`). It imports no training framework: a loop calls one method per event. It only
asks :func:`~mbridge_mxfp8_plugin.probes.probe_live_loop` whether an imported Bridge or Megatron-LM
loop stages before every forced sync; then, core doing the rest, every event returns at once
(:attr:`ParamSyncEngine.passive`; an optimizer-less eval still marks the groups synced). Where
Megatron-FSDP or LayerWise (Muon) owns the param sync (:attr:`ParamSyncEngine.owner`), it never acts.

Events (methods of :class:`ParamSyncEngine`): ``prepare`` once per job (probe, repair offsets, plan
copies); ``step_started`` when a step begins; ``stage_for_step`` before a step's forwards where the
loop never stages (NeMo 2); ``before_forced_sync`` right before a forced sync with no hook between it
and the reader, ``refresh_for_save`` before a save that may not; ``before_eval`` /
``after_forced_sync`` around eval, test, save; ``training_ended`` after the loop's closing sync;
``refresh_weights`` when something outside training reads the weights; ``forced_sync_unobserved``
after a forced sync no event announced.

Background (reuse mode): an MXFP8 bucket's bf16 ``param_data`` is a view of its grad buffer,
which holds reduced gradients between the optimizer step and the next forward until someone
stages the main params. A forced all-gather gathers whatever was staged last, and on
megatron-core < 0.18 nobody copies the result into the params at all.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MXFP8UsageError
from ..mcore.buckets import AlignmentReport, check_bucket_alignment
from ..mcore.layout import bucket_groups, distributed_optimizers, is_megatron_ddp
from ..probes import CoreBehaviour, probe_core
from ..probes.owners import SyncOwner, optimizer_sync_owner
from .applies import Decision, decide, loop_does_the_work
from .plan import StagePlans, WriteBackPlan

__all__ = ["ParamSyncEngine", "SyncStats"]

#: stamps for ParamSyncEngine.refresh_stamp
_REFRESH_STAMPS = itertools.count(1)


@dataclass
class SyncStats:
    """What one engine call did; adapters log it and tests count collectives with it."""

    all_gathers: int = 0
    params_written: int = 0
    buckets_zeroed: int = 0
    groups_reset: int = 0
    staged: bool = False
    seconds: float = 0.0
    note: str = ""


class ParamSyncEngine:
    """Keeps MXFP8 params correct around forced param syncs for one set of model chunks. Cheap to
    construct (:meth:`prepare` does the one-time work); :meth:`step_started` is a flag check per group.
    """

    def __init__(
        self,
        model_chunks: Sequence[Any],
        optimizer: Any | None = None,
        *,
        behaviour: CoreBehaviour | None = None,
        decision: Decision | None = None,
    ) -> None:
        """``decision``: the adapter's :func:`~.applies.decide` for these chunks, taken once."""
        bad = [i for i, c in enumerate(model_chunks) if not is_megatron_ddp(c)]
        if bad:
            raise MXFP8UsageError(
                f"model chunk(s) {bad} are {type(model_chunks[bad[0]]).__name__}, not megatron-core "
                "DistributedDataParallel; the MXFP8 param-sync fixes apply only to megatron-core DDP "
                "with the distributed optimizer"
            )
        self.model_chunks = list(model_chunks)
        decision = decision or decide(self.model_chunks, optimizer)
        #: Megatron-FSDP or the LayerWise optimizer owns the param sync: the engine never acts.
        self.owner: SyncOwner | None = decision.owner
        self.optimizer = None if self.owner else optimizer
        self.behaviour = behaviour or probe_core()
        self.active = decision.applies
        self.overlap = any(c.ddp_config.overlap_param_gather for c in self.model_chunks)
        self._write_plan: WriteBackPlan | None = None
        self._stage_plans = StagePlans()
        self.alignment: AlignmentReport | None = None
        self.weights_fresh = False  # param.data = current main params (set by a refresh, cleared by a step)
        #: process-wide stamp of this engine's last real refresh (0: none); unique across engines, so
        #: ensure_weights_current tells its own refresh from a later one by any engine of the model
        self.refresh_stamp = 0
        self._staged_ahead = False  # staged for a forced sync the loop is about to issue
        self._loop_stages = False  # last answer of loop_stages_itself(), read through passive

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def model_key(model_chunks: Sequence[Any]) -> tuple[int, ...]:
        """Identity of a set of model chunks: what the shared engine (and each adapter) is keyed by."""
        return tuple(id(c) for c in model_chunks)

    @classmethod
    def shared(
        cls, model_chunks: Sequence[Any], optimizer: Any | None = None, *, decision: Decision | None = None
    ) -> ParamSyncEngine:
        """The one engine of these model chunks, created on first use.

        Two callbacks on the same model (registered twice, or a Bridge and a Lightning adapter)
        must not both write back: the second would copy the buffer the first just re-zeroed.
        Sharing the engine makes every step idempotent.
        """
        key = cls.model_key(model_chunks)
        engine = _SHARED.get(key)
        if engine is None or any(a is not b for a, b in zip(engine.model_chunks, model_chunks, strict=True)):
            engine = cls(model_chunks, optimizer, decision=decision)
            _SHARED[key] = engine
        else:
            engine.bind_optimizer(optimizer)
        return engine

    def bind_optimizer(self, optimizer: Any | None) -> None:
        """Use this Megatron optimizer (chained or not) for staging; ``None`` keeps the bound one.

        Adapters pass whatever their event carries: Bridge's eval contexts and Lightning's
        validation hooks have no optimizer, and the engine must keep the one seen in training.
        """
        if optimizer is None or optimizer is self.optimizer or self.owner is not None:
            return
        self.owner = optimizer_sync_owner(optimizer)
        if self.owner is not None:  # e.g. LayerWise (Muon): its buckets are not ours to stage
            self.active, self.optimizer = False, None
            return
        self.optimizer = optimizer
        self._stage_plans.clear()
        if self._loop_stages:
            self.loop_stages_itself()  # the new optimizer's own config decides core 0.19's staging

    def prepare(self, *, repair_offsets: bool = True) -> AlignmentReport | None:
        """Repair bucket offsets (defect A) and plan the write-back copies. Idempotent."""
        if not self.active:
            return None
        if self.alignment is not None and (self.alignment.repaired or not repair_offsets):
            return self.alignment
        self.alignment = check_bucket_alignment(self.model_chunks, repair=repair_offsets)
        # The write-back reads the repaired offsets: plan it now, not at the first eval.
        self._write_plan = WriteBackPlan.build(self.model_chunks)
        return self.alignment

    def _writes(self) -> WriteBackPlan:
        self._write_plan = self._write_plan or WriteBackPlan.build(self.model_chunks)
        return self._write_plan

    # ------------------------------------------------------------------ queries
    def bucket_groups(self) -> list[Any]:
        """Every dense and expert-parallel bucket group of every chunk, in dispatch-table order."""
        return bucket_groups(self.model_chunks)

    def forward_pre_hooks_enabled(self) -> bool:
        """The chunks' param-gather pre-hooks are registered: the test megatron-core's own loops use
        before staging (``remove_forward_pre_hook_handles``, Megatron-LM core_v0.16.1 training.py L1643)."""
        return all(len(getattr(c, "remove_forward_pre_hook_handles", None) or {}) for c in self.model_chunks)

    def loop_stages_itself(self) -> bool:
        """Ask again whether the running loop and core do all of the plugin's work
        (:func:`~.applies.loop_does_the_work`); remembered in :attr:`passive`."""
        self._loop_stages = loop_does_the_work(self.behaviour, self.optimizer)
        return self._loop_stages

    @property
    def passive(self) -> bool:
        """The last :meth:`loop_stages_itself` said yes: every event method returns at once (no
        collective, staging or write; an optimizer-less eval only marks the groups synced)."""
        return self._loop_stages

    def synced_without_gather_in_flight(self) -> bool:
        """Every group looks like a forced sync just ran: dispatched, no handle outstanding."""
        groups = self.bucket_groups()
        return bool(groups) and all(
            g.param_gather_dispatched and g.param_gather_handle is None for g in groups
        )

    def gather_in_flight(self) -> bool:
        """An asynchronous param all-gather is still writing into some bucket."""
        return any(g.param_gather_handle is not None for g in self._writes().groups)

    # ------------------------------------------------------------------ events, one method each
    def step_started(self) -> SyncStats:
        """A training step begins: the weights will change, and what a forced sync since the last
        step left behind must not make this step skip its gather (defect C)."""
        self.weights_fresh = False
        self._staged_ahead = False
        return self._reset_dispatch()

    def stage_for_step(self) -> bool:
        """Stage the main params for this step's forwards, for loops that never do it (NeMo 2).

        Call after the step's ``zero_grad_buffer()`` and before its first forward. Stages only
        when a gather is certain to follow (pre-hooks on, nothing dispatched): staged values that
        are not gathered and re-zeroed by ``finish_param_sync`` become gradients.
        """
        if not (self.active and self.overlap) or self.optimizer is None or self._loop_stages:
            return False
        self._reset_dispatch()
        if not self.forward_pre_hooks_enabled():
            return False
        if any(g.param_gather_dispatched for g in self.bucket_groups()):
            return False
        return self.stage_main_params()

    def before_forced_sync(self, *, save: bool = False) -> SyncStats:
        """The loop will force a param sync next (eval, checkpoint save) with no hook in between.

        Stages the main params so the loop's own forced all-gather collects weights, not the
        gradients in the shared buffer (B2), and no second gather is needed. For a save on core
        < 0.18 (no write-back, no hook before the write) the weights are refreshed now and the
        gathered buffer kept, so the save's gather collects the same values. Skipped while an
        eval's gather is in flight (its :meth:`before_eval` gathers itself); a save waits for it.
        """
        if self._loop_stages:
            return _passive()
        if not (self.active and self.overlap) or self.optimizer is None:
            return SyncStats(note="nothing to stage")
        if save and not self.behaviour.forced_sync_writes_back:
            return self.refresh_weights(gathered_fresh=False, keep_gathered=True)
        if save:
            self._wait_in_flight()
        stats = SyncStats(staged=self.stage_main_params())
        self._staged_ahead = stats.staged
        return stats

    def refresh_for_save(self) -> SyncStats:
        """A save reads ``param.data`` next, and the loop may or may not force a param sync first
        (Lightning strategies differ; NeMo 2's does, with no hook after it): refresh now and, where
        core writes forced gathers back (>= 0.18), stage again so a sync that follows gathers weights,
        not the re-zeroed buffer. Loops that always force one right before a save (Megatron-LM,
        Bridge) use ``before_forced_sync(save=True)``: no gather of its own on core >= 0.18."""
        if self._loop_stages:
            return _passive()
        stats = self.refresh_weights(gathered_fresh=False)
        if self.optimizer is not None and self.behaviour.forced_sync_writes_back:
            stats.staged = self.stage_main_params()
        return stats

    def before_eval(self, *, gathered_fresh: bool | None = None) -> SyncStats:
        """Eval or test is about to read the weights: make them the current main params.

        Without an optimizer (eval-only jobs, validation before fit) nothing has stepped, so
        ``param.data`` is exactly what was initialised or loaded and is only protected from the
        pre-hooks. ``gathered_fresh=None`` lets the engine judge whether the loop's forced gather
        collected freshly staged weights (:meth:`_judge_fresh`); ``True``/``False`` overrides.

        The shared buffer is not re-zeroed after the write-back: a training step follows, and its
        ``zero_grad_buffer()`` clears the buffer before any gradient lands there; a forced gather
        in between (a save) collects the same weights again.
        """
        if self.optimizer is None:
            return self._hold()
        if self._loop_stages:
            return _passive()
        return self._refresh(gathered_fresh=self._judge_fresh(gathered_fresh), zero=False)

    def after_forced_sync(self, *, restage: bool = True) -> SyncStats:
        """An eval, test or save (anything that forced a param sync) is over; training resumes.

        Resets the dispatch state so the next step gathers, copies and re-zeroes (C). With
        ``restage`` and where core writes forced gathers back (>= 0.18), stages the main params
        again, so a save in the same iteration that fires no hook before its forced sync gathers
        weights rather than the buffer the write-back zeroed. Loops that call
        :meth:`before_forced_sync` before every save can pass ``restage=False``.
        """
        self._staged_ahead = False
        if self._loop_stages:
            return _passive()
        stats = self._reset_dispatch()
        if (
            restage
            and self.optimizer is not None
            and self.active
            and self.overlap
            and self.behaviour.forced_sync_writes_back
        ):
            stats.staged = self.stage_main_params()
            self._staged_ahead = stats.staged
        return stats

    def forced_sync_unobserved(self) -> None:
        """The loop may have forced a param sync no event announced (Bridge < 0.5 saves right before
        its closing disable, with no callback). On core >= 0.18 it wrote the staged params back and
        re-zeroed the buffer, so a later forced gather collected zeros: what was staged no longer
        counts as fresh. On core < 0.18 the buffer is left as gathered."""
        if self.behaviour.forced_sync_writes_back and not self._loop_stages:
            self._staged_ahead = False

    def training_ended(self, *, gathered_fresh: bool | None = None) -> SyncStats:
        """Training is over (after the loop's closing forced sync): make the weights current for a
        test eval or an export (``gathered_fresh`` as in :meth:`before_eval`). Nothing to do where
        the loop stages itself: its final save and closing disable staged, core wrote back."""
        if self._loop_stages:
            return _passive()
        return self.refresh_weights(gathered_fresh=gathered_fresh)

    def refresh_weights(
        self, *, gathered_fresh: bool | None = None, keep_gathered: bool = False
    ) -> SyncStats:
        """Make ``param.data`` equal the current main params (rounded to the param dtype), on demand
        (an export, a save on core < 0.18): unlike the event methods it acts even where the loop
        stages itself, since after a step the params are stale there too until a forced sync.

        ``gathered_fresh`` as in :meth:`before_eval` (``True``: a forced gather already collected
        freshly staged main params; only core's missing copy-back is done, no collective). Leaves
        every group "synced" (dispatched, no handle), so active pre-hooks do not gather again. The
        buffer is re-zeroed unless ``keep_gathered=True``: a forced gather the framework issues
        next (a save on core < 0.18) then collects the same values, not zeros; the next step's
        ``zero_grad_buffer`` clears them before any gradient lands there."""
        return self._refresh(gathered_fresh=self._judge_fresh(gathered_fresh), zero=not keep_gathered)

    def stage_main_params(self) -> bool:
        """Copy every rank's fp32 main-param shard into its slice of the param buffer.

        Returns False (and does nothing) while an all-gather is in flight: staging into a buffer
        that the collective is still writing would race, and dropping that gather's handle would
        skip its copy-back. Callers that must stage anyway (a full refresh) wait first.
        """
        if self.optimizer is None:
            raise MXFP8UsageError(
                "no Megatron optimizer known to the MXFP8 plugin: the fp32 main params live in the "
                "distributed optimizer; pass optimizer= (Bridge: the callback takes it from "
                "on_train_start / on_train_step_start)"
            )
        if self.gather_in_flight():
            return False
        opts = distributed_optimizers(self.optimizer)
        if not opts:
            raise MXFP8UsageError(
                f"optimizer {type(self.optimizer).__name__} holds no megatron-core DistributedOptimizer; "
                "MXFP8 params with reuse_grad_buf_for_mxfp8_param_ag need use_distributed_optimizer=True"
            )
        for opt in opts:
            self._stage_plans.stage(opt)
            if self.behaviour.has_dispatch_reset:
                # Core >= 0.19's staging also re-arms the pre-hooks (C's fix); keep that contract.
                for chunk in opt.model_chunks:
                    chunk.reset_param_sync_dispatch_state()
        return True

    # ------------------------------------------------------------------ internals
    def _wait_in_flight(self) -> None:
        # The refresh re-stages and re-gathers everything, so the in-flight gather's own
        # copy-back is superseded; only its completion matters.
        for group in self._writes().groups:
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()
                group.param_gather_handle = None

    def _judge_fresh(self, gathered_fresh: bool | None) -> bool:
        """Did the loop's last forced gather collect freshly staged main params?

        Yes when the engine staged for it (:meth:`before_forced_sync`, or
        :meth:`after_forced_sync` re-staging) or the loop stages itself, no step ran since, and
        every group still looks just synced (dispatched, no gather in flight).
        """
        if gathered_fresh is not None:
            return gathered_fresh
        staged = self._staged_ahead or self._loop_stages
        return staged and self.synced_without_gather_in_flight()

    def _refresh(self, *, gathered_fresh: bool, zero: bool) -> SyncStats:
        stats = SyncStats()
        if not (self.active and self.overlap):
            stats.note = "inactive" if not self.active else "no overlap_param_gather: weights already current"
            return stats
        t0 = time.perf_counter()
        groups = self._writes().groups
        if self.weights_fresh:
            # Nothing stepped since the last refresh: the weights are right; just make sure no
            # pre-hook gathers the buffer over them.
            for group in groups:
                group.param_gather_dispatched = True
            stats.note = "weights already fresh"
        elif gathered_fresh:
            stats.note = "reused the forced gather"
        else:
            self._wait_in_flight()
            stats.staged = self.stage_main_params()
            for group in groups:
                group.start_param_sync(force_sync=True)
                stats.all_gathers += 1
        if not self.weights_fresh and not self.behaviour.forced_sync_writes_back:
            stats.buckets_zeroed += self._writes().run(zero=zero)
            stats.params_written += self._writes().params
        if not self.weights_fresh:
            self.refresh_stamp = next(_REFRESH_STAMPS)
        self.weights_fresh = True
        self._staged_ahead = False
        stats.seconds = time.perf_counter() - t0
        return stats

    def _hold(self) -> SyncStats:
        """Keep ``param.data`` as it is through an eval that may run with pre-hooks active.

        For eval-only jobs and evals before the first step (no optimizer seen yet): the weights
        are exactly as initialised or loaded, but the shared buffer holds no params, so a forward
        pre-hook that gathers would overwrite them with zeros. Marking the groups synced makes the
        hooks skip; :meth:`after_forced_sync` undoes it.
        """
        stats = SyncStats(note="held weights as loaded")
        if self.active and self.overlap:
            for group in self._writes().groups:
                if group.param_gather_handle is None:
                    group.param_gather_dispatched = True
        return stats

    def _reset_dispatch(self) -> SyncStats:
        """Undo what a forced sync leaves behind, so the next step gathers, copies and re-zeroes.

        A forced sync sets ``param_gather_dispatched`` without a handle; the next forward
        pre-hook then skips the gather, the copy-back and the re-zeroing (defect C). Groups with a
        gather in flight are left alone: that gather is legitimate (e.g. dispatched by the
        optimizer step with ``overlap_param_gather_with_optimizer_step``) and resetting its flag
        would dispatch a second all-gather into the same buffer.
        """
        stats = SyncStats()
        if not (self.active and self.overlap) or self.behaviour.has_dispatch_reset:
            # Core >= 0.19 resets the flag itself when the loop stages the main params.
            return stats
        for group in self._writes().groups:
            if group.param_gather_dispatched and group.param_gather_handle is None:
                group.param_gather_dispatched = False
                stats.groups_reset += 1
        return stats


def _passive() -> SyncStats:
    # The loop stages and core writes back and resets: acting would repeat it (a stage dirties the buffer).
    return SyncStats(note="passive: the loop stages itself")


_SHARED: weakref.WeakValueDictionary[tuple[int, ...], ParamSyncEngine] = weakref.WeakValueDictionary()
