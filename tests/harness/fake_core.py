"""Single-process stand-ins for megatron-core's DDP chunk, bucket groups, buckets and distributed
optimizer, for the unit tier only (every other tier runs the real classes on spawned ranks).

They model one rank of the reuse mode (``reuse_grad_buf_for_mxfp8_param_ag``): each bucket's bf16
``param_data`` is the first half of its fp32 grad buffer, so whatever the buffer holds when a
gather runs is what the params receive. The all-gather of one rank is the identity, so "gathered"
means "whatever the buffer holds". What a forced sync does differs by release, as docs/upstream.md
records: core >= 0.18 copies a forced gather back and re-zeroes (B1 fixed), core >= 0.19 resets
the dispatch state when the main params are staged (C fixed). Counters let tests see every
collective, staging and copy the engine causes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

N = 64  # one param per bucket, 64 elements: aligned, so defect A stays out of the way


@dataclass(frozen=True)
class Release:
    """What a megatron-core release's param-sync code does by itself (docs/upstream.md's defect table)."""

    name: str
    forced_sync_writes_back: bool  # B1 fixed (0.18.0)
    has_dispatch_reset: bool  # C fixed (0.19.0)
    has_prepare_for_param_sync: bool  # 0.19.0

    def behaviour(self) -> Any:
        from mbridge_mxfp8_plugin.probes import CoreBehaviour

        return CoreBehaviour(
            forced_sync_writes_back=self.forced_sync_writes_back,
            has_dispatch_reset=self.has_dispatch_reset,
            has_prepare_for_param_sync=self.has_prepare_for_param_sync,
            has_reuse_knob=True,
        )


CORE_0161 = Release("0.16.1", False, False, False)
CORE_0182 = Release("0.18.2", True, False, False)
CORE_0192 = Release("0.19.2", True, True, True)
RELEASES = (CORE_0161, CORE_0182, CORE_0192)


class Handle:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1


@dataclass
class Bucket:
    params_list: list[torch.nn.Parameter]
    grad_data: torch.Tensor
    param_data: torch.Tensor
    param_to_index: dict[Any, tuple[int, int]]
    offset: int = 0


@dataclass
class Buffer:
    buckets: list[Bucket]
    param_index_map: dict[Any, tuple[int, int, int]]
    ddp_config: Any


@dataclass
class BucketGroup:
    """``_ParamAndGradBucketGroup``'s param-gather state machine, one rank."""

    buckets: list[Bucket]
    release: Release
    param_gather_dispatched: bool = False
    param_gather_handle: Handle | None = None
    gathers: int = 0
    forced_gathers: int = 0

    def start_param_sync(self, force_sync: bool = False) -> None:
        if force_sync and self.param_gather_handle is not None:  # core: wait for the async one
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            return
        self.gathers += 1
        self.param_gather_dispatched = True
        if force_sync:
            self.forced_gathers += 1
            if self.release.forced_sync_writes_back:  # _post_param_sync (0.18+)
                self._copy_back_and_zero()
        else:
            self.param_gather_handle = Handle()

    def finish_param_sync(self) -> None:
        """What a forward pre-hook does: gather if nothing was dispatched, copy back what is in flight."""
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            self._copy_back_and_zero()

    def _copy_back_and_zero(self) -> None:
        with torch.no_grad():
            for b in self.buckets:
                for p in b.params_list:
                    start, end = b.param_to_index[p]
                    p.copy_(b.param_data[start:end])
                b.param_data.zero_()


class Chunk:
    """A megatron-core ``DistributedDataParallel`` chunk: owns ``buffers`` (a list) and groups."""

    def __init__(self, release: Release, groups: list[BucketGroup], buffers: list[Buffer], ddp_config: Any):
        self.buffers = buffers
        self.bucket_groups = groups
        self.expert_parallel_bucket_groups: list[BucketGroup] = []
        self.expert_parallel_buffers: list[Buffer] = []
        self.ddp_config = ddp_config
        self.remove_forward_pre_hook_handles: dict[Any, Any] = {}
        self.release = release
        self.dispatch_resets = 0
        self.enable_forward_pre_hook()

    def enable_forward_pre_hook(self) -> None:
        self.remove_forward_pre_hook_handles = {p: object() for p in self.parameters()}

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.remove_forward_pre_hook_handles = {}
        if param_sync:
            for g in self.all_groups():
                g.start_param_sync(force_sync=True)

    def all_groups(self) -> list[BucketGroup]:
        return [*self.bucket_groups, *self.expert_parallel_bucket_groups]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for g in self.all_groups() for b in g.buckets for p in b.params_list]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"p{i}", p) for i, p in enumerate(self.parameters())]

    def zero_grad_buffer(self) -> None:
        for g in self.all_groups():
            for b in g.buckets:
                b.grad_data.zero_()

    def __getattr__(self, name: str) -> Any:
        if name == "reset_param_sync_dispatch_state" and self.__dict__["release"].has_dispatch_reset:
            return self._reset_dispatch
        raise AttributeError(name)

    def _reset_dispatch(self) -> None:
        self.dispatch_resets += 1
        for g in self.all_groups():
            if g.param_gather_handle is None:
                g.param_gather_dispatched = False


class DistOpt(DistributedOptimizer):
    """A distributed optimizer holding one fp32 main param per model param (no real state)."""

    def __init__(self, chunks: list[Chunk], mains: dict[Any, torch.Tensor], config: Any) -> None:
        self.model_chunks = chunks
        self.mains = mains
        self.config = config
        self.stagings = 0

    def _copy_main_params_to_param_buffer(self) -> None:
        self.stagings += 1
        with torch.no_grad():
            for c in self.model_chunks:
                for g in c.all_groups():
                    for b in g.buckets:
                        for p in b.params_list:
                            start, end = b.param_to_index[p]
                            b.param_data[start:end].copy_(self.mains[p])
                if c.release.has_dispatch_reset:  # 0.19: staging re-arms the pre-hooks (C fixed)
                    c.reset_param_sync_dispatch_state()

    def step(self, value: float) -> None:
        """An optimizer step: new main params, reduced gradients left in the shared buffer."""
        for main in self.mains.values():
            main.fill_(value)
        for c in self.model_chunks:
            for g in c.all_groups():
                for b in g.buckets:
                    b.grad_data.fill_(123.0)


@dataclass
class Job:
    release: Release
    chunk: Chunk
    opt: DistOpt
    groups: list[BucketGroup] = field(default_factory=list)

    def params(self) -> list[torch.nn.Parameter]:
        return self.chunk.parameters()

    def weights(self) -> list[float]:
        """The distinct values every param holds, sorted: [2.0] means "all params are 2.0"."""
        return sorted({float(v) for p in self.params() for v in p.detach().float().unique()})


def make_job(release: Release, *, groups: int = 2, overlap: bool = True) -> Job:
    """One chunk, ``groups`` bucket groups of one bucket of one bf16 param; params and main params 1.0."""
    ddp_config = SimpleNamespace(
        reuse_grad_buf_for_mxfp8_param_ag=True,
        use_distributed_optimizer=True,
        overlap_param_gather=overlap,
        use_megatron_fsdp=False,
    )
    made, buffers, mains = [], [], {}
    for _ in range(groups):
        p = torch.nn.Parameter(torch.ones(N, dtype=torch.bfloat16), requires_grad=False)
        grad = torch.zeros(N, dtype=torch.float32)
        bucket = Bucket([p], grad, grad.view(torch.bfloat16)[:N], {p: (0, N)})
        buffers.append(Buffer([bucket], {p: (0, N, 0)}, ddp_config))
        made.append(BucketGroup([bucket], release))
        mains[p] = torch.ones(N, dtype=torch.float32)
    chunk = Chunk(release, made, buffers, ddp_config)
    opt_config = SimpleNamespace(reuse_grad_buf_for_mxfp8_param_ag=True, overlap_param_gather=overlap)
    return Job(release, chunk, DistOpt([chunk], mains, opt_config), made)


class BucketlessChunk:
    """megatron-core's DDP chunk as the entry points' discovery sees it: the ``ddp_config`` knobs of
    the mode (reuse + distributed optimizer + overlapped gather by default) and no buckets, so an
    engine builds on it and has nothing to copy or gather."""

    def __init__(self, reuse: bool = True) -> None:
        self.ddp_config = SimpleNamespace(
            reuse_grad_buf_for_mxfp8_param_ag=reuse,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            use_megatron_fsdp=False,
        )
        self.buffers: list[Buffer] = []
        self.bucket_groups: list[BucketGroup] = []
