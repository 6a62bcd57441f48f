"""Copy planning for the engine: which tensor goes where, worked out once per job.

The engine (:mod:`.sync`) decides *when* to stage or write back; this module knows *what* those
copies are: each rank's fp32 main-param shards into their slices of the param buffer (staging),
and a bucket's gathered ``param_data`` into the params (the write-back megatron-core < 0.18 lacks).
Both run on every param of the model at each eval, so they are planned once and run as a few
batched kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..mcore.layout import (
    LAYOUT_ERRORS,
    bucket_groups,
    bucket_params,
    buffers,
    group_buckets,
    main_shards,
    padded_range,
)

__all__ = ["StagePlans", "WriteBackPlan"]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (TE) expose no plain storage
        return False


@dataclass
class WriteBackPlan:
    """Every copy of one write-back (gathered buffer -> params), flattened across buckets and groups.

    Flat lists keep the host cost at one bound-method call per quantized param plus a constant
    number of batched kernels (one ``_foreach_copy_`` for all plain params, one ``_foreach_zero_``
    for all buffers shared with the gradients).
    """

    #: quantized params: the param's own ``copy_`` (it quantizes) and its source view.
    quantized: list[tuple[Callable[[torch.Tensor], Any], torch.Tensor]]
    #: unmapped plain (bf16) params and their sources.
    plain_dst: list[torch.Tensor]
    plain_src: list[torch.Tensor]
    #: quantized params that live on the buffer (non-reuse layouts): core's post-processing.
    mapped_quantized: list[torch.nn.Parameter]
    #: ``param_data`` that aliases a grad buffer: zeroed before gradients land there.
    shared_buffers: list[torch.Tensor]
    #: the bucket groups, in dispatch-table order.
    groups: list[Any]
    #: how many params one write-back writes.
    params: int

    @classmethod
    def build(cls, model_chunks: Sequence[Any]) -> WriteBackPlan:
        from megatron.core import fp8_utils

        buffer_of = {id(bucket): ref.buffer for ref in buffers(model_chunks) for bucket in ref.bucket_list}
        plan = cls([], [], [], [], [], bucket_groups(model_chunks), 0)
        for bucket in (b for g in plan.groups for b in group_buckets(g)):
            flat = bucket.param_data.view(-1)
            for param in bucket_params(bucket):
                quantized = fp8_utils.is_float8tensor(param)
                if not fp8_utils.is_mxfp8tensor(param) and _same_storage(param.data, bucket.param_data):
                    # bf16 params (core >= 0.17) and non-MXFP8 quantized params live on the
                    # buffer already; copying into them is a no-op at best, zeroing erases them.
                    if quantized:
                        plan.mapped_quantized.append(param)
                    continue
                # The buffer's padded index map, not bucket.param_to_index (defect A on core <= 0.16).
                start, end = padded_range(buffer_of[id(bucket)], bucket, param)
                src = flat[start:end].view(param.data.shape)
                if quantized:
                    # Through param.data would cost a tensor-subclass alias per param.
                    plan.quantized.append((param.copy_, src))
                else:
                    plan.plain_dst.append(param)
                    plan.plain_src.append(src)
                plan.params += 1
            if bucket.param_data is not None and _same_storage(bucket.param_data, bucket.grad_data):
                plan.shared_buffers.append(bucket.param_data)
        return plan

    def run(self, *, zero: bool) -> int:
        """Copy the gathered buffers into the params; returns how many buffers were zeroed."""
        from megatron.core import fp8_utils

        # megatron-core <= 0.15 has no post-all-gather step (added in 0.16), and nothing to run.
        post_all_gather_processing = getattr(fp8_utils, "post_all_gather_processing", None)
        zeroed = 0
        # Safe under no_grad: no autograd graph holds the params between steps.
        with torch.no_grad():
            for copy_, src in self.quantized:
                copy_(src)
            if self.plain_dst:
                torch._foreach_copy_(self.plain_dst, self.plain_src)
            if self.mapped_quantized and post_all_gather_processing is not None:
                post_all_gather_processing(self.mapped_quantized)
            if zero and self.shared_buffers:
                # Otherwise the gathered bf16 values would be read as gradients by a backward
                # that is not preceded by zero_grad_buffer().
                torch._foreach_zero_(self.shared_buffers)
                zeroed = len(self.shared_buffers)
        for group in self.groups:
            group.param_gather_dispatched = True
        return zeroed


class StagePlans:
    """Per distributed optimizer: (buffer shard views, fp32 main shards), built once each.

    The same views and values as core's ``_copy_main_params_to_param_buffer`` (main shard -> its
    bucket slice), run as one batched copy instead of core's per-param loop.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}

    def clear(self) -> None:
        self._by_id.clear()

    def stage(self, opt: Any) -> None:
        """Copy ``opt``'s main shards into the param buffer (core's own copy for layouts we cannot
        plan, e.g. the precision-aware optimizer)."""
        plan = self._get(opt)
        if plan is None:
            opt._copy_main_params_to_param_buffer()
        elif plan[0]:
            # No autograd: a main param rebuilt by a second optimizer (NeMo: validate, then fit)
            # is model_param.float(), which carries grad history, and recording the copy into
            # buffer views made under no_grad (validation) breaks the next gather.
            with torch.no_grad():
                torch._foreach_copy_(plan[0], plan[1])

    def _get(self, opt: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        cached = self._by_id.get(id(opt))
        if cached is not None and cached[0] is opt:
            return cached[1]
        plan = self._build(opt)
        if plan is not None:  # an unplannable layout is asked again (and copied by core) each time
            self._by_id[id(opt)] = (opt, plan)
        return plan

    @staticmethod
    def _build(opt: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        try:
            for shard in main_shards(opt):
                if shard.main is None:
                    return None
                dst.append(shard.bucket_data.view(-1)[shard.bucket_start : shard.bucket_end])
                src.append(shard.main)
        except LAYOUT_ERRORS:
            return None
        return dst, src
