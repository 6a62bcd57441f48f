"""Probes: what the installed megatron-core already does right.

Every decision the plugin takes comes from behaviour found here, never from a version string:
a backported fix in a vendor build is honoured, and an unreleased regression is not masked.
Defect A is a property of a live model's buckets and is probed in :mod:`.buckets`.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

__all__ = ["CoreBehaviour", "probe_core", "installed_versions"]


@dataclass(frozen=True)
class CoreBehaviour:
    """What megatron-core's param-sync code does by itself."""

    #: ``_ParamAndGradBucketGroup._post_param_sync`` exists: a forced (synchronous) all-gather
    #: copies the gathered buffer into the params and re-zeroes it (defect B1 fixed).
    forced_sync_writes_back: bool
    #: ``DistributedDataParallel.reset_param_sync_dispatch_state`` exists (defect C fixed in core).
    has_dispatch_reset: bool
    #: ``DistributedOptimizer.prepare_model_params_for_param_sync`` exists: core can stage the
    #: fp32 main params into the shared buffer itself (the helper behind B2's fix).
    has_prepare_for_param_sync: bool
    #: The knob exists at all (megatron-core >= 0.14 releases have it).
    has_reuse_knob: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def probe_core() -> CoreBehaviour:
    """Inspect the imported megatron-core classes (cached: the code cannot change at run time)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    group_cls = pgb._ParamAndGradBucketGroup
    return CoreBehaviour(
        forced_sync_writes_back=callable(getattr(group_cls, "_post_param_sync", None)),
        has_dispatch_reset=callable(getattr(DistributedDataParallel, "reset_param_sync_dispatch_state", None)),
        has_prepare_for_param_sync=callable(
            getattr(DistributedOptimizer, "prepare_model_params_for_param_sync", None)
        ),
        has_reuse_knob="reuse_grad_buf_for_mxfp8_param_ag"
        in getattr(DistributedDataParallelConfig, "__dataclass_fields__", {}),
    )


def installed_versions() -> dict[str, str | None]:
    """Distribution versions, for reports only (decisions come from :func:`probe_core`)."""
    out: dict[str, str | None] = {}
    for dist in ("torch", "megatron-core", "megatron-bridge", "lightning", "transformer-engine"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
