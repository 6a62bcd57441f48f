"""megatron-core's DDP and distributed-optimizer layout, read here and nowhere else.

The engine (what to stage and write back), the verifier (what to compare) and
``ensure_weights_current`` (what changed) all walk the same structures: a chunk's dense and
expert-parallel param buffers, their buckets and bucket groups, and the distributed optimizer's
fp32 main shards with the slice of the param and of the bucket each one covers. These attribute
names are private to megatron-core and have moved between releases; a release that renames one
is a change in this module only (``tests/unit/test_layering.py`` greps the package for them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "LAYOUT_ERRORS",
    "BufferRef",
    "MainShard",
    "bucket_groups",
    "bucket_params",
    "buffers",
    "chunk_bucket_groups",
    "distributed_optimizers",
    "group_buckets",
    "has_layer_wise_marks",
    "is_megatron_ddp",
    "is_megatron_fsdp",
    "main_params",
    "main_shards",
    "padded_range",
    "reuse_mode_active",
]

#: What reading a layout this module does not know raises (a renamed attribute, a missing map
#: entry, another optimizer's shapes); callers turn it into "unchecked" or core's own path.
LAYOUT_ERRORS = (AttributeError, KeyError, TypeError, ValueError)


def is_megatron_ddp(chunk: Any) -> bool:
    """Duck-typed: megatron-core's ``DistributedDataParallel`` (not Megatron-FSDP, not torch DDP).

    The DDP keeps its param buffers in an instance attribute ``buffers`` (a list, shadowing
    ``nn.Module.buffers``). NeMo's ``MegatronParallel`` and its per-chunk wrappers forward unknown
    attribute lookups to the DDP inside, so ``ddp_config`` and ``bucket_groups`` resolve on them
    too while their ``buffers`` is the ``nn.Module`` method; only the object that owns the list
    counts. Callers reach the DDP under a wrapper through ``.module``.
    """
    try:
        own = vars(chunk)
    except TypeError:  # no __dict__: not a module
        return False
    if not isinstance(own.get("buffers"), (list, tuple)):
        return False
    return all(hasattr(chunk, a) for a in ("ddp_config", "bucket_groups")) and not getattr(
        chunk.ddp_config, "use_megatron_fsdp", False
    )


def is_megatron_fsdp(obj: Any) -> bool:
    """A Megatron-FSDP wrapper (``ddp_config.use_megatron_fsdp``): it has none of these defects, so
    discovery stops there instead of walking into the model."""
    return hasattr(obj, "ddp_config") and bool(getattr(obj.ddp_config, "use_megatron_fsdp", False))


def reuse_mode_active(model_chunks: Sequence[Any]) -> bool:
    """True when the chunks share grad and param buffers for MXFP8 params (the affected mode)."""
    return any(
        is_megatron_ddp(c)
        and getattr(c.ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False)
        and c.ddp_config.use_distributed_optimizer
        for c in model_chunks
    )


@dataclass(frozen=True)
class BufferRef:
    """One param buffer of a chunk, with where it sits (for reports) and whose replicas it holds."""

    chunk_index: int
    chunk: Any
    expert: bool
    index: int
    buffer: Any

    @property
    def bucket_list(self) -> list[Any]:
        return list(self.buffer.buckets)

    @property
    def data_parallel_group(self) -> Any:
        """The group the buffer's params are replicated over (expert params: the expert DP group)."""
        wanted = "expt_dp_group" if self.expert else "dp_cp_group"
        return getattr(self.chunk, wanted, None) or getattr(self.buffer, "data_parallel_group", None)

    @property
    def param_data(self) -> Any:
        return self.buffer.param_data

    @property
    def grad_data(self) -> Any:
        return self.buffer.grad_data


def buffers(model_chunks: Sequence[Any]) -> Iterator[BufferRef]:
    """Every dense, then every expert-parallel buffer of each chunk, in a stable order."""
    for c, chunk in enumerate(model_chunks):
        for expert, held in ((False, chunk.buffers), (True, getattr(chunk, "expert_parallel_buffers", []))):
            for b, buffer in enumerate(held):
                yield BufferRef(c, chunk, expert, b, buffer)


def bucket_params(bucket: Any) -> list[Any]:
    """The params of one bucket, in the bucket's order."""
    return list(bucket.params_list)


def padded_range(buffer: Any, bucket: Any, param: Any) -> tuple[int, int]:
    """The param's true (start, end) inside its bucket, from the buffer's padded layout.

    The buffer's ``param_index_map`` is what the optimizer and the ``main_grad`` views use; the
    bucket's own ``param_to_index`` ignores the padding on core <= 0.16 (defect A).
    """
    start, end, _ = buffer.param_index_map[param]
    return start - bucket.offset, end - bucket.offset


def chunk_bucket_groups(chunk: Any) -> list[Any]:
    """A chunk's dense and expert-parallel bucket groups, in dispatch-table order."""
    return list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", []))


def bucket_groups(model_chunks: Sequence[Any]) -> list[Any]:
    """Every bucket group of every chunk, in dispatch-table order."""
    return [g for c in model_chunks for g in chunk_bucket_groups(c)]


def group_buckets(group: Any) -> list[Any]:
    return list(group.buckets)


def has_layer_wise_marks(obj: Any) -> bool:
    """Core's own marks of LayerWise-managed buckets on a DDP-like object: params tagged by
    ``tag_params_for_buffer_routing`` (main), buckets given ``set_layerwise_params_list``.

    Tolerant of anything (it is asked of every wrapper a model may hold): no buffers, no marks.
    """
    for attr in ("buffers", "expert_parallel_buffers"):
        held = getattr(obj, attr, None)
        if not isinstance(held, (list, tuple)):
            continue
        for buffer in held:
            for bucket in getattr(buffer, "buckets", ()):
                if getattr(bucket, "layerwise_params_list", None) is not None:
                    return True
                if any(getattr(p, "is_managed_by_layer_wise_optimizer", False) for p in bucket.params_list):
                    return True
    return False


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` instances behind a (possibly chained) Megatron optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    members = getattr(optimizer, "chained_optimizers", None)
    candidates = list(members) if members is not None else [optimizer]
    return [o for o in candidates if isinstance(o, DistributedOptimizer)]


class MainShard(NamedTuple):
    """One fp32 main shard a distributed optimizer holds on this rank, and where it belongs.

    ``main`` is None where the optimizer keeps its main params inside itself (the
    precision-aware optimizer): the shard exists but cannot be read from here. A named tuple,
    not a frozen dataclass: one is made per param at a weight check's first call and at the
    engine's planning, and a tuple is made several times faster.
    """

    param: Any
    main: Any
    #: the shard's slice of the flattened param
    param_start: int
    param_end: int
    #: the shard's slice of its bucket's flattened ``param_data`` (where staging writes it)
    bucket_start: int
    bucket_end: int
    #: the bucket's ``param_data`` (None where the bucket has no param buffer)
    bucket_data: Any


def main_shards(optimizer: Any) -> Iterator[MainShard]:
    """Every main shard of one ``DistributedOptimizer``; raises one of :data:`LAYOUT_ERRORS` where
    its layout is not the one core's own ``_copy_main_params_to_param_buffer`` reads."""
    for mains, params in zip(
        optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups, strict=True
    ):
        for main, param in zip(mains, params, strict=True):
            ranges = optimizer._get_model_param_range_map(param)
            own, world = ranges["param"], ranges["gbuf_world_in_bucket"]
            gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[param]
            data = optimizer.buffers[gbuf_index].buckets[bucket_id].param_data
            yield MainShard(param, main, own.start, own.end, world.start, world.end, data)


def main_params(optimizer: Any) -> list[Any]:
    """The fp32 main shards of every distributed optimizer behind ``optimizer`` (None skipped).
    A list built in one comprehension: the weight check reads it at every call."""
    return [
        m
        for opt in distributed_optimizers(optimizer)
        for group in opt.shard_fp32_from_float16_groups
        for m in group
        if m is not None
    ]
