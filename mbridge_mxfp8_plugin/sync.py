"""The engine: make the model's weights right around forced param syncs (defects B and C).

Framework-neutral: it knows megatron-core DDP model chunks, bucket groups and distributed
optimizers, nothing about Bridge or Lightning. Adapters translate their hooks into three calls:

* :meth:`ParamSyncEngine.prepare` once per job (probe, repair offsets, plan the copies);
* :meth:`ParamSyncEngine.refresh_weights` before anything reads the weights outside training
  (eval, test, export): stage fp32 main params, gather, write back, re-zero;
* :meth:`ParamSyncEngine.restore_for_training` after any forced sync, so the next step gathers,
  writes back and re-zeroes instead of reading params as gradients.

Background (reuse mode, ``reuse_grad_buf_for_mxfp8_param_ag=True``): an MXFP8 bucket's bf16
``param_data`` is a view of its grad buffer. Between the optimizer step and the next forward the
buffer holds reduced gradients; the main params reach it only when someone stages them. A forced
all-gather therefore gathers whatever was staged last, and on megatron-core < 0.18 nobody copies
the result into the params at all.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .buckets import AlignmentReport, check_bucket_alignment, expected_index, is_megatron_ddp
from .errors import MXFP8UsageError
from .upstream import CoreBehaviour, probe_core

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
    #: param_data aliases the grad buffer: must be zeroed after the copy or it becomes gradient.
    shared_with_grads: bool


@dataclass
class _GroupPlan:
    group: Any
    buckets: list[_BucketPlan] = field(default_factory=list)


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


class ParamSyncEngine:
    """Keeps MXFP8 params correct around forced param syncs for one set of model chunks.

    Cheap to construct; :meth:`prepare` does the one-time work. Holding the engine costs nothing
    per training step: :meth:`restore_for_training` is a flag check per bucket group.
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
        self._stage_plans: dict[int, tuple[Any, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self.alignment: AlignmentReport | None = None
        #: param.data holds the current main params (set by a refresh, cleared by a train step).
        self.weights_fresh = False

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
        elif optimizer is not None:
            engine.optimizer = optimizer
        return engine

    def prepare(self, *, repair_offsets: bool = True) -> AlignmentReport | None:
        """Repair bucket offsets (defect A) and plan the write-back copies. Idempotent."""
        if not self.active:
            return None
        if self.alignment is not None and (self.alignment.repaired or not repair_offsets):
            return self.alignment
        self.alignment = check_bucket_alignment(self.model_chunks, repair=repair_offsets)
        self._plans = None
        self._plan()
        return self.alignment

    def bucket_groups(self) -> list[Any]:
        """Every dense and expert-parallel bucket group of every chunk, in dispatch-table order."""
        return [
            g
            for c in self.model_chunks
            for g in list(c.bucket_groups) + list(getattr(c, "expert_parallel_bucket_groups", []))
        ]

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
        return self._plans

    # ------------------------------------------------------------------ steps
    def note_training_step(self) -> None:
        """The optimizer may have changed the main params: param.data is no longer known fresh."""
        self.weights_fresh = False

    def synced_without_gather_in_flight(self) -> bool:
        """Every group looks like a forced sync just ran: dispatched, no handle outstanding."""
        groups = self.bucket_groups()
        return bool(groups) and all(
            g.param_gather_dispatched and g.param_gather_handle is None for g in groups
        )

    def gather_in_flight(self) -> bool:
        """An asynchronous param all-gather is still writing into some bucket."""
        return any(plan.group.param_gather_handle is not None for plan in self._plan())

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
                torch._foreach_copy_(plan[0], plan[1])
            if self.behaviour.has_dispatch_reset:
                # Core >= 0.19's staging also re-arms the pre-hooks (C's fix); keep that contract.
                for chunk in opt.model_chunks:
                    chunk.reset_param_sync_dispatch_state()
        return True

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

    def weights_for_eval(self, *, gathered_fresh: bool = False) -> SyncStats:
        """What every adapter does before eval/test: refresh, or hold the weights if no optimizer.

        Without an optimizer (eval-only jobs, validation before fit) nothing has stepped, so
        ``param.data`` is exactly what was initialised or loaded.
        """
        if self.optimizer is None:
            return self.hold_weights()
        return self.refresh_weights(gathered_fresh=gathered_fresh)

    def back_to_training(self) -> SyncStats:
        """What every adapter does after eval/test: restore (C) and, where core writes forced
        gathers back (>= 0.18), re-stage so a save in the same iteration gathers weights rather
        than the re-zeroed buffer."""
        stats = self.restore_for_training()
        if (
            self.optimizer is not None
            and self.active
            and self.overlap
            and self.behaviour.forced_sync_writes_back
        ):
            stats.staged = self.stage_main_params()
        return stats

    def refresh_weights(self, *, gathered_fresh: bool = False, keep_gathered: bool = False) -> SyncStats:
        """Make ``param.data`` equal the current main params (rounded to the param dtype).

        ``gathered_fresh=True`` says a forced all-gather already ran over freshly staged main
        params since the last optimizer step (e.g. the framework staged before its forced sync,
        or the adapter staged ahead of it): then only the copy-back that core lacks is done and
        no collective is issued. Leaves every bucket group "synced" (dispatched, no handle), so
        forward pre-hooks that stay active during eval do not gather again.

        ``keep_gathered=True`` leaves the gathered params in the shared buffer instead of zeroing
        it: a forced all-gather the framework issues next (a checkpoint save on core < 0.18) then
        gathers the same values again instead of zeros. The next step's ``zero_grad_buffer``
        clears them before any gradient lands there.
        """
        stats = SyncStats()
        if not (self.active and self.overlap):
            stats.note = "inactive" if not self.active else "no overlap_param_gather: weights already current"
            return stats
        t0 = time.perf_counter()
        plans = self._plan()
        if self.weights_fresh:
            # Nothing stepped since the last refresh: the weights are right; just make sure no
            # pre-hook gathers the (zeroed) buffer over them.
            for plan in plans:
                plan.group.param_gather_dispatched = True
            stats.note = "weights already fresh"
        elif gathered_fresh:
            if not self.behaviour.forced_sync_writes_back:
                self._write_back(plans, stats, zero=not keep_gathered)
            stats.note = "reused the forced gather"
        else:
            self._wait_in_flight()
            stats.staged = self.stage_main_params()
            for plan in plans:
                plan.group.start_param_sync(force_sync=True)
                stats.all_gathers += 1
            if not self.behaviour.forced_sync_writes_back:
                self._write_back(plans, stats, zero=not keep_gathered)
        self.weights_fresh = True
        stats.seconds = time.perf_counter() - t0
        return stats

    def _write_back(self, plans: list[_GroupPlan], stats: SyncStats, *, zero: bool = True) -> None:
        from megatron.core import fp8_utils

        # megatron-core <= 0.15 has no post-all-gather step (added in 0.16), and nothing to run.
        post_all_gather_processing = getattr(fp8_utils, "post_all_gather_processing", None)
        with torch.no_grad():
            for plan in plans:
                for bp in plan.buckets:
                    for copy in bp.copies:
                        # The param's own copy_ quantizes (TE's QuantizedTensor and the emulation
                        # alike); going through param.data would cost a tensor-subclass alias per
                        # param. Safe under no_grad: no autograd graph holds the params here.
                        copy.param.copy_(copy.src)
                    if bp.plain_dst:
                        torch._foreach_copy_(bp.plain_dst, bp.plain_src)
                    stats.params_written += len(bp.copies) + len(bp.plain_dst)
                    if bp.mapped_quantized and post_all_gather_processing is not None:
                        post_all_gather_processing(bp.mapped_quantized)
                    if bp.shared_with_grads and zero:
                        # The gathered bf16 values would otherwise be read as gradients.
                        bp.bucket.param_data.zero_()
                        stats.buckets_zeroed += 1
                plan.group.param_gather_dispatched = True

    def hold_weights(self) -> SyncStats:
        """Keep ``param.data`` as it is through an eval that may run with pre-hooks active.

        For eval-only jobs and evals before the first step (no optimizer seen yet): the weights
        are exactly as initialised or loaded, but the shared buffer holds no params, so a forward
        pre-hook that gathers would overwrite them with zeros. Marking the groups synced makes the
        hooks skip; :meth:`restore_for_training` undoes it.
        """
        stats = SyncStats(note="held weights as loaded")
        if self.active and self.overlap:
            for plan in self._plan():
                if plan.group.param_gather_handle is None:
                    plan.group.param_gather_dispatched = True
        return stats

    def restore_for_training(self) -> SyncStats:
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
