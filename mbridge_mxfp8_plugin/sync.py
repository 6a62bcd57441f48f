"""The engine: make the model's weights right around forced param syncs (defects B and C).

Framework-neutral: it knows megatron-core DDP model chunks, bucket groups and distributed
optimizers, nothing about Bridge, Lightning or Megatron-LM's ``training.py``; every read or write
of megatron-core's param-sync state lives here (and in :mod:`.buckets` for the offsets). A loop
tells the engine what is about to happen, one method per event:

* :meth:`ParamSyncEngine.prepare` once per job (probe, repair offsets, plan the copies);
* :meth:`ParamSyncEngine.step_started` when a training step begins;
* :meth:`ParamSyncEngine.stage_for_step` before a step's forwards, for loops that never stage
  the main params themselves (NeMo 2);
* :meth:`ParamSyncEngine.before_forced_sync` when the loop is about to force a param sync
  (eval, checkpoint save) and no hook will run between that sync and the reader;
* :meth:`ParamSyncEngine.before_save` before a save that may or may not force a sync first;
* :meth:`ParamSyncEngine.before_eval` / :meth:`ParamSyncEngine.after_forced_sync` around eval
  and test, and after a save;
* :meth:`ParamSyncEngine.refresh_weights` when something outside training reads the weights
  (the end of training, an export);
* :meth:`ParamSyncEngine.forced_sync_unobserved` when the loop may have forced a sync that no
  event announced.

The public loop-agnostic API (:mod:`.api`) and both callbacks are thin translations onto these.

Background (reuse mode, ``reuse_grad_buf_for_mxfp8_param_ag=True``): an MXFP8 bucket's bf16
``param_data`` is a view of its grad buffer. Between the optimizer step and the next forward the
buffer holds reduced gradients; the main params reach it only when someone stages them. A forced
all-gather therefore gathers whatever was staged last, and on megatron-core < 0.18 nobody copies
the result into the params at all.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .buckets import AlignmentReport, check_bucket_alignment, expected_index, is_megatron_ddp
from .errors import MXFP8UsageError
from .upstream import CoreBehaviour, probe_core, probe_live_loop

__all__ = ["ParamSyncEngine", "SyncStats", "distributed_optimizers", "reuse_mode_active"]


def reuse_mode_active(model_chunks: Sequence[Any]) -> bool:
    """True when the chunks share grad and param buffers for MXFP8 params (the affected mode)."""
    return any(
        is_megatron_ddp(c)
        and getattr(c.ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False)
        and c.ddp_config.use_distributed_optimizer
        for c in model_chunks
    )


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` instances behind a (possibly chained) Megatron optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    members = getattr(optimizer, "chained_optimizers", None)
    candidates = list(members) if members is not None else [optimizer]
    return [o for o in candidates if isinstance(o, DistributedOptimizer)]


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


@dataclass
class _Copy:
    param: torch.nn.Parameter
    src: torch.Tensor  # view of the bucket's gathered param_data, in the param's shape


@dataclass
class _BucketPlan:
    bucket: Any
    #: quantized params: one quantizing copy each (the param's own copy_ does the cast).
    copies: list[_Copy]
    #: unmapped plain (bf16) params and their sources: one batched copy for all of them.
    plain_dst: list[torch.Tensor]
    plain_src: list[torch.Tensor]
    #: quantized params that live on the buffer (non-reuse layouts): core's post-processing.
    mapped_quantized: list[torch.nn.Parameter]
    #: param_data aliases the grad buffer: must be zeroed before gradients land there.
    shared_with_grads: bool


@dataclass
class _GroupPlan:
    group: Any
    buckets: list[_BucketPlan] = field(default_factory=list)


@dataclass
class _WriteBack:
    """Every copy of one write-back, flattened across buckets and groups at plan time.

    The write-back runs once per eval on every param of the model; flattening keeps its host
    cost at one bound-method call per quantized param plus a constant number of batched kernels
    (one ``_foreach_copy_`` for all plain params, one ``_foreach_zero_`` for all shared buffers).
    """

    quantized: list[tuple[Callable[[torch.Tensor], Any], torch.Tensor]]
    plain_dst: list[torch.Tensor]
    plain_src: list[torch.Tensor]
    mapped_quantized: list[torch.nn.Parameter]
    shared_buffers: list[torch.Tensor]
    groups: list[Any]
    params: int


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (TE) expose no plain storage
        return False


def _plan_bucket(bucket: Any, buffer: Any) -> _BucketPlan:
    from megatron.core import fp8_utils

    copies: list[_Copy] = []
    plain_dst: list[torch.Tensor] = []
    plain_src: list[torch.Tensor] = []
    mapped_quantized: list[torch.nn.Parameter] = []
    flat = bucket.param_data.view(-1)
    for param in bucket.params_list:
        quantized = fp8_utils.is_float8tensor(param)
        mapped = not fp8_utils.is_mxfp8tensor(param) and _same_storage(param.data, bucket.param_data)
        if mapped:
            # bf16 params (core >= 0.17) and non-MXFP8 quantized params live on the buffer
            # already; copying into them would be a no-op at best, zeroing would erase them.
            if quantized:
                mapped_quantized.append(param)
            continue
        # The buffer's padded index map, not bucket.param_to_index (defect A on core <= 0.16).
        start, end = expected_index(buffer, bucket, param)
        src = flat[start:end].view(param.data.shape)
        if quantized:
            copies.append(_Copy(param, src))
        else:
            plain_dst.append(param)
            plain_src.append(src)
    shared = bucket.param_data is not None and _same_storage(bucket.param_data, bucket.grad_data)
    return _BucketPlan(bucket, copies, plain_dst, plain_src, mapped_quantized, shared)


def _flatten(plans: list[_GroupPlan]) -> _WriteBack:
    buckets = [bp for plan in plans for bp in plan.buckets]
    return _WriteBack(
        # The param's own copy_ quantizes (TE's QuantizedTensor and the emulation alike); going
        # through param.data would cost a tensor-subclass alias per param.
        quantized=[(c.param.copy_, c.src) for bp in buckets for c in bp.copies],
        plain_dst=[d for bp in buckets for d in bp.plain_dst],
        plain_src=[s for bp in buckets for s in bp.plain_src],
        mapped_quantized=[p for bp in buckets for p in bp.mapped_quantized],
        shared_buffers=[bp.bucket.param_data for bp in buckets if bp.shared_with_grads],
        groups=[plan.group for plan in plans],
        params=sum(len(bp.copies) + len(bp.plain_dst) for bp in buckets),
    )


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"ParamSyncEngine.{old}() is deprecated; call ParamSyncEngine.{new}() instead",
        DeprecationWarning,
        stacklevel=3,
    )


class ParamSyncEngine:
    """Keeps MXFP8 params correct around forced param syncs for one set of model chunks.

    Cheap to construct; :meth:`prepare` does the one-time work. Holding the engine costs nothing
    per training step: :meth:`step_started` is a flag check per bucket group.
    """

    def __init__(
        self,
        model_chunks: Sequence[Any],
        optimizer: Any | None = None,
        *,
        behaviour: CoreBehaviour | None = None,
    ) -> None:
        bad = [i for i, c in enumerate(model_chunks) if not is_megatron_ddp(c)]
        if bad:
            raise MXFP8UsageError(
                f"model chunk(s) {bad} are {type(model_chunks[bad[0]]).__name__}, not megatron-core "
                "DistributedDataParallel; the MXFP8 param-sync fixes apply only to megatron-core DDP "
                "with the distributed optimizer"
            )
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        self.behaviour = behaviour or probe_core()
        self.active = reuse_mode_active(self.model_chunks)
        self.overlap = any(c.ddp_config.overlap_param_gather for c in self.model_chunks)
        self._plans: list[_GroupPlan] | None = None
        self._write_plan: _WriteBack | None = None
        self._stage_plans: dict[int, tuple[Any, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self.alignment: AlignmentReport | None = None
        #: param.data holds the current main params (set by a refresh, cleared by a train step).
        self.weights_fresh = False
        #: main params were staged for a forced sync the loop is about to issue (cleared by a step)
        self._staged_ahead = False
        #: last answer of loop_stages_itself(): the loop stages before every forced sync itself
        self._loop_stages = False

    # ------------------------------------------------------------------ set-up
    @classmethod
    def shared(cls, model_chunks: Sequence[Any], optimizer: Any | None = None) -> ParamSyncEngine:
        """The one engine of these model chunks, created on first use.

        Two callbacks on the same model (registered twice, or a Bridge and a Lightning adapter)
        must not both write back: the second would copy the buffer the first just re-zeroed.
        Sharing the engine makes every step idempotent.
        """
        key = tuple(id(c) for c in model_chunks)
        engine = _SHARED.get(key)
        if engine is None or any(a is not b for a, b in zip(engine.model_chunks, model_chunks, strict=True)):
            engine = cls(model_chunks, optimizer)
            _SHARED[key] = engine
        else:
            engine.bind_optimizer(optimizer)
        return engine

    def bind_optimizer(self, optimizer: Any | None) -> None:
        """Use this Megatron optimizer (chained or not) for staging; ``None`` keeps the bound one.

        Adapters pass whatever their event carries: Bridge's eval contexts and Lightning's
        validation hooks have no optimizer, and the engine must keep the one seen in training.
        """
        if optimizer is None or optimizer is self.optimizer:
            return
        self.optimizer = optimizer
        self._stage_plans.clear()

    def prepare(self, *, repair_offsets: bool = True) -> AlignmentReport | None:
        """Repair bucket offsets (defect A) and plan the write-back copies. Idempotent."""
        if not self.active:
            return None
        if self.alignment is not None and (self.alignment.repaired or not repair_offsets):
            return self.alignment
        self.alignment = check_bucket_alignment(self.model_chunks, repair=repair_offsets)
        self._plans = None
        self._write_plan = None
        self._plan()
        return self.alignment

    def _plan(self) -> list[_GroupPlan]:
        if self._plans is None:
            buffer_of = {}
            for c in self.model_chunks:
                for buffer in list(c.buffers) + list(getattr(c, "expert_parallel_buffers", [])):
                    for bucket in buffer.buckets:
                        buffer_of[id(bucket)] = buffer
            self._plans = [
                _GroupPlan(g, [_plan_bucket(b, buffer_of[id(b)]) for b in g.buckets])
                for g in self.bucket_groups()
            ]
            self._write_plan = None
        return self._plans

    def _writes(self) -> _WriteBack:
        plans = self._plan()
        if self._write_plan is None:
            self._write_plan = _flatten(plans)
        return self._write_plan

    # ------------------------------------------------------------------ queries
    def bucket_groups(self) -> list[Any]:
        """Every dense and expert-parallel bucket group of every chunk, in dispatch-table order."""
        return [
            g
            for c in self.model_chunks
            for g in list(c.bucket_groups) + list(getattr(c, "expert_parallel_bucket_groups", []))
        ]

    def forward_pre_hooks_enabled(self) -> bool:
        """The chunks' param-gather forward pre-hooks are registered (the loop has not disabled them).

        The same test megatron-core's own loops use before staging (``len(model[0].
        remove_forward_pre_hook_handles) > 0``, Megatron-LM core_v0.16.1 training.py L1643).
        """
        return all(
            len(getattr(c, "remove_forward_pre_hook_handles", None) or {}) > 0 for c in self.model_chunks
        )

    def loop_stages_itself(self) -> bool:
        """The running loop stages the main params before every forced sync, and core does the rest.

        True only when all of these hold: megatron-core writes forced gathers back (B1), resets
        the dispatch state (C) and offers ``prepare_model_params_for_param_sync`` (>= 0.19); the
        loaded training loop (Megatron-Bridge >= 0.6, Megatron-LM core_v0.19) calls it before its
        forced syncs; and every distributed optimizer's *own* config has both
        ``reuse_grad_buf_for_mxfp8_param_ag`` and ``overlap_param_gather`` (core 0.19 stages only
        then). Then every engine action would only repeat core's work. The answer is remembered:
        :meth:`before_eval` then trusts the loop's forced gather.
        """
        beh = self.behaviour
        stages = (
            beh.has_prepare_for_param_sync
            and beh.forced_sync_writes_back
            and beh.has_dispatch_reset
            and bool(probe_live_loop())
            and self.optimizer is not None
        )
        if stages:
            opts = distributed_optimizers(self.optimizer)
            stages = bool(opts) and all(
                getattr(o.config, "reuse_grad_buf_for_mxfp8_param_ag", False)
                and getattr(o.config, "overlap_param_gather", False)
                for o in opts
            )
        self._loop_stages = bool(stages)
        return self._loop_stages

    def synced_without_gather_in_flight(self) -> bool:
        """Every group looks like a forced sync just ran: dispatched, no handle outstanding."""
        groups = self.bucket_groups()
        return bool(groups) and all(
            g.param_gather_dispatched and g.param_gather_handle is None for g in groups
        )

    def gather_in_flight(self) -> bool:
        """An asynchronous param all-gather is still writing into some bucket."""
        return any(plan.group.param_gather_handle is not None for plan in self._plan())

    # ------------------------------------------------------------------ actions, one per event
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
        if not (self.active and self.overlap) or self.optimizer is None:
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
        gradients in the shared buffer (B2), and no second gather is needed. For a save on
        core < 0.18, which never writes a forced gather back and fires no hook before the write,
        the weights are refreshed now instead and the gathered buffer is kept, so the save's own
        gather collects the same values. Skipped while an eval's gather is in flight (the eval's
        :meth:`before_eval` then gathers itself); a save waits for it.
        """
        stats = SyncStats()
        if not (self.active and self.overlap) or self.optimizer is None:
            stats.note = "nothing to stage"
            return stats
        if save and not self.behaviour.forced_sync_writes_back:
            return self.refresh_weights(keep_gathered=True)
        if save:
            self._wait_in_flight()
        stats.staged = self.stage_main_params()
        self._staged_ahead = stats.staged
        return stats

    def before_save(self) -> SyncStats:
        """A checkpoint save reads ``param.data`` next, and the loop may or may not force a param
        sync first (Lightning strategies differ; NeMo 2's does, with no hook after it).

        Refreshes the weights now and, where core writes forced gathers back (>= 0.18), stages the
        main params again, so a forced sync that does follow gathers weights rather than the
        buffer the refresh's write-back re-zeroed. Loops that always force a sync right before a
        save, with no hook in between (Megatron-LM, Bridge), use
        ``before_forced_sync(save=True)``, which issues no gather of its own on core >= 0.18.
        """
        stats = self.refresh_weights()
        if self.optimizer is not None and self.behaviour.forced_sync_writes_back:
            stats.staged = self.stage_main_params()
        return stats

    def before_eval(self, *, gathered_fresh: bool | None = None) -> SyncStats:
        """Eval or test is about to read the weights: make them the current main params.

        Without an optimizer (eval-only jobs, validation before fit) nothing has stepped, so
        ``param.data`` is exactly what was initialised or loaded and is only protected from the
        pre-hooks. ``gathered_fresh=None`` lets the engine judge whether the loop's forced gather
        collected freshly staged weights (staged by :meth:`before_forced_sync` or
        :meth:`after_forced_sync`, or by a loop that stages itself); ``True``/``False`` overrides.

        The shared buffer is not re-zeroed after the write-back: a training step follows, and its
        ``zero_grad_buffer()`` clears the buffer before any gradient lands there; a forced gather
        in between (a save) collects the same weights again.
        """
        if self.optimizer is None:
            return self._hold()
        return self._refresh(gathered_fresh=self._judge_fresh(gathered_fresh), zero=False)

    def after_forced_sync(self, *, restage: bool = True) -> SyncStats:
        """An eval, test or save (anything that forced a param sync) is over; training resumes.

        Resets the dispatch state so the next step gathers, copies and re-zeroes (C). With
        ``restage`` and where core writes forced gathers back (>= 0.18), stages the main params
        again, so a save in the same iteration that fires no hook before its forced sync gathers
        weights rather than the buffer the write-back zeroed. Loops that call
        :meth:`before_forced_sync` before every save can pass ``restage=False``.
        """
        stats = self._reset_dispatch()
        self._staged_ahead = False
        if (
            restage
            and not self._loop_stages
            and self.optimizer is not None
            and self.active
            and self.overlap
            and self.behaviour.forced_sync_writes_back
        ):
            stats.staged = self.stage_main_params()
            self._staged_ahead = stats.staged
        return stats

    def forced_sync_unobserved(self) -> None:
        """The loop may have forced a param sync that no event announced (Bridge < 0.5 saves right
        before its closing disable and fires no callback for that save).

        On core >= 0.18 such a sync wrote the staged main params back and re-zeroed the shared
        buffer, so a forced gather after it collected zeros: what was staged no longer counts
        when :meth:`refresh_weights` or :meth:`before_eval` judge freshness. On core < 0.18 the
        buffer is left as gathered, and a loop that stages itself re-stages before every sync.
        """
        if self.behaviour.forced_sync_writes_back and not self._loop_stages:
            self._staged_ahead = False

    def refresh_weights(
        self, *, gathered_fresh: bool | None = False, keep_gathered: bool = False
    ) -> SyncStats:
        """Make ``param.data`` equal the current main params (rounded to the param dtype).

        For readers outside training (the end of training, an export, a save on core < 0.18).
        ``gathered_fresh=True`` says a forced all-gather already ran over freshly staged main
        params since the last optimizer step: then only the copy-back that core lacks is done and
        no collective is issued; ``None`` lets the engine judge, as in :meth:`before_eval`.
        Leaves every bucket group "synced" (dispatched, no handle), so forward pre-hooks that
        stay active do not gather again.

        The shared buffer is re-zeroed afterwards unless ``keep_gathered=True``, which leaves the
        gathered params there: a forced all-gather the framework issues next (a checkpoint save
        on core < 0.18) then gathers the same values again instead of zeros. The next step's
        ``zero_grad_buffer`` clears them before any gradient lands there.
        """
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
            plan = self._stage_plan(opt)
            if plan is None:
                # Layout we cannot plan (e.g. precision-aware optimizer): core's own per-param copy.
                opt._copy_main_params_to_param_buffer()
                continue
            if plan[0]:
                # One batched copy instead of core's per-param loop (the same shard views and
                # values as _copy_main_params_to_param_buffer: main shard -> its bucket slice).
                # No autograd: a main param rebuilt by a second optimizer (NeMo: validate, then
                # fit) is model_param.float(), which carries grad history, and recording the
                # copy into buffer views made under no_grad (validation) breaks the next gather.
                with torch.no_grad():
                    torch._foreach_copy_(plan[0], plan[1])
            if self.behaviour.has_dispatch_reset:
                # Core >= 0.19's staging also re-arms the pre-hooks (C's fix); keep that contract.
                for chunk in opt.model_chunks:
                    chunk.reset_param_sync_dispatch_state()
        return True

    # ------------------------------------------------------------------ deprecated names
    # ParamSyncEngine is public, so code written against the earlier names keeps working for
    # now; nothing in the package or its tests calls them.
    def weights_for_eval(self, *, gathered_fresh: bool = False) -> SyncStats:
        """Deprecated: :meth:`before_eval`."""
        _deprecated("weights_for_eval", "before_eval")
        return self.before_eval(gathered_fresh=gathered_fresh)

    def back_to_training(self) -> SyncStats:
        """Deprecated: :meth:`after_forced_sync`."""
        _deprecated("back_to_training", "after_forced_sync")
        return self.after_forced_sync()

    def restore_for_training(self) -> SyncStats:
        """Deprecated: :meth:`step_started` at a step, :meth:`after_forced_sync` after a sync."""
        _deprecated("restore_for_training", "step_started or after_forced_sync")
        return self._reset_dispatch()

    def note_training_step(self) -> None:
        """Deprecated: :meth:`step_started`."""
        _deprecated("note_training_step", "step_started")
        self.weights_fresh = False
        self._staged_ahead = False

    def hold_weights(self) -> SyncStats:
        """Deprecated: :meth:`before_eval` holds the weights when no optimizer is bound."""
        _deprecated("hold_weights", "before_eval")
        return self._hold()

    # ------------------------------------------------------------------ internals
    def _stage_plan(self, opt: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """(buffer shard views, fp32 main shards) of one distributed optimizer, built once."""
        key = id(opt)
        if key in self._stage_plans:
            cached_opt, plan = self._stage_plans[key]
            if cached_opt is opt:
                return plan
        try:
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            for mains, params in zip(
                opt.shard_fp32_from_float16_groups, opt.model_float16_groups, strict=True
            ):
                for main, param in zip(mains, params, strict=True):
                    if main is None:
                        return None
                    world = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[param]
                    buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                    dst.append(buffer.view(-1)[world.start : world.end])
                    src.append(main)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        self._stage_plans[key] = (opt, (dst, src))
        return dst, src

    def _wait_in_flight(self) -> None:
        # The refresh re-stages and re-gathers everything, so the in-flight gather's own
        # copy-back is superseded; only its completion matters.
        for plan in self._plan():
            if plan.group.param_gather_handle is not None:
                plan.group.param_gather_handle.wait()
                plan.group.param_gather_handle = None

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
        plans = self._plan()
        if self.weights_fresh:
            # Nothing stepped since the last refresh: the weights are right; just make sure no
            # pre-hook gathers the buffer over them.
            for plan in plans:
                plan.group.param_gather_dispatched = True
            stats.note = "weights already fresh"
        elif gathered_fresh:
            if not self.behaviour.forced_sync_writes_back:
                self._write_back(stats, zero=zero)
            stats.note = "reused the forced gather"
        else:
            self._wait_in_flight()
            stats.staged = self.stage_main_params()
            for plan in plans:
                plan.group.start_param_sync(force_sync=True)
                stats.all_gathers += 1
            if not self.behaviour.forced_sync_writes_back:
                self._write_back(stats, zero=zero)
        self.weights_fresh = True
        self._staged_ahead = False
        stats.seconds = time.perf_counter() - t0
        return stats

    def _write_back(self, stats: SyncStats, *, zero: bool = True) -> None:
        from megatron.core import fp8_utils

        # megatron-core <= 0.15 has no post-all-gather step (added in 0.16), and nothing to run.
        post_all_gather_processing = getattr(fp8_utils, "post_all_gather_processing", None)
        w = self._writes()
        # Safe under no_grad: no autograd graph holds the params between steps.
        with torch.no_grad():
            for copy_, src in w.quantized:
                copy_(src)
            if w.plain_dst:
                torch._foreach_copy_(w.plain_dst, w.plain_src)
            if w.mapped_quantized and post_all_gather_processing is not None:
                post_all_gather_processing(w.mapped_quantized)
            if zero and w.shared_buffers:
                # Otherwise the gathered bf16 values would be read as gradients by a backward
                # that is not preceded by zero_grad_buffer().
                torch._foreach_zero_(w.shared_buffers)
                stats.buckets_zeroed += len(w.shared_buffers)
        stats.params_written += w.params
        for group in w.groups:
            group.param_gather_dispatched = True

    def _hold(self) -> SyncStats:
        """Keep ``param.data`` as it is through an eval that may run with pre-hooks active.

        For eval-only jobs and evals before the first step (no optimizer seen yet): the weights
        are exactly as initialised or loaded, but the shared buffer holds no params, so a forward
        pre-hook that gathers would overwrite them with zeros. Marking the groups synced makes the
        hooks skip; :meth:`after_forced_sync` undoes it.
        """
        stats = SyncStats(note="held weights as loaded")
        if self.active and self.overlap:
            for plan in self._plan():
                if plan.group.param_gather_handle is None:
                    plan.group.param_gather_dispatched = True
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
        for plan in self._plan():
            group = plan.group
            if group.param_gather_dispatched and group.param_gather_handle is None:
                group.param_gather_dispatched = False
                stats.groups_reset += 1
        return stats


_SHARED: weakref.WeakValueDictionary[tuple[int, ...], ParamSyncEngine] = weakref.WeakValueDictionary()
