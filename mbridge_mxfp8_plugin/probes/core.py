"""What the installed megatron-core already does right, as one record with two sources.

Every decision the plugin takes comes from behaviour found here, never from a version string:
a backported fix in a vendor build is honoured, and an unreleased regression is not masked.
The runtime reads the imported classes (:func:`probe_core`); ``check`` and ``doctor`` read the
same facts from the installed files (:func:`probe_core_files`), because importing torch and
megatron-core costs seconds on a login node. A test holds the two equal on the installed core.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..common.records import record
from ._source import block, init_signature, megatron_subdir, read_text

__all__ = ["CoreBehaviour", "core_package_dir", "probe_bucket_offsets", "probe_core", "probe_core_files"]

_PGB = "distributed/param_and_grad_buffer.py"


@record
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
    #: ``_ParamAndGradBucket.__init__`` takes the buffer's padded ``param_index_map``, so bucket
    #: offsets honour the 64-element padding (defect A fixed); ``None``: not probed.
    #: :func:`probe_bucket_offsets` tests the same thing by behaviour.
    pads_bucket_offsets: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def probe_core() -> CoreBehaviour:
    """Inspect the imported megatron-core classes (cached: the code cannot change at run time)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ddp = DistributedDataParallel
    return CoreBehaviour(
        forced_sync_writes_back=callable(getattr(pgb._ParamAndGradBucketGroup, "_post_param_sync", None)),
        has_dispatch_reset=callable(getattr(ddp, "reset_param_sync_dispatch_state", None)),
        has_prepare_for_param_sync=callable(
            getattr(DistributedOptimizer, "prepare_model_params_for_param_sync", None)
        ),
        has_reuse_knob="reuse_grad_buf_for_mxfp8_param_ag"
        in getattr(DistributedDataParallelConfig, "__dataclass_fields__", {}),
        pads_bucket_offsets="param_index_map"
        in inspect.signature(pgb._ParamAndGradBucket.__init__).parameters,
    )


def core_package_dir() -> Path | None:
    """``megatron/core`` of the installed megatron-core, found without importing it."""
    return megatron_subdir("core", _PGB)


@functools.lru_cache(maxsize=4)
def probe_core_files(core_dir: str | None = None) -> CoreBehaviour | None:
    """:func:`probe_core`'s answers read from the installed sources as text; None when no
    megatron-core is installed (so callers can say "unknown", not "none")."""
    root = Path(core_dir) if core_dir else core_package_dir()
    if root is None:
        return None
    pgb = read_text(root, _PGB)
    return CoreBehaviour(
        forced_sync_writes_back="def _post_param_sync(" in block(pgb, "class", "_ParamAndGradBucketGroup"),
        has_dispatch_reset="def reset_param_sync_dispatch_state("
        in read_text(root, "distributed/distributed_data_parallel.py"),
        has_prepare_for_param_sync="def prepare_model_params_for_param_sync("
        in read_text(root, "optimizer/distrib_optimizer.py"),
        has_reuse_knob="reuse_grad_buf_for_mxfp8_param_ag"
        in read_text(root, "distributed/distributed_data_parallel_config.py"),
        pads_bucket_offsets="param_index_map" in init_signature(block(pgb, "class", "_ParamAndGradBucket")),
    )


def probe_bucket_offsets() -> bool:
    """Defect A by behaviour: does ``_ParamAndGradBucket`` honour the buffer's padded param layout?

    Builds one CPU bucket with two 10-element params that the buffer placed at 0 and 64 (the
    distributed optimizer's 64-element start padding) and reads ``bucket.param_to_index``.
    Returns True when the second param's offset is 64 (fixed, megatron-core >= 0.17), False when it
    is the naive running sum 10 (defect A). Constructor arguments are matched by name, so a
    backport that adds ``param_index_map`` counts as fixed.
    """
    import torch
    from megatron.core.distributed import param_and_grad_buffer as pgb

    params = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(10))]
    offered: dict[str, Any] = {
        "params": params,
        "param_data": None,
        "grad_data": torch.zeros(128),
        "offset": 0,
        "numel_unpadded": 74,
        "gradient_scaling_factor": 1.0,
        "bucket_id": 0,
        "param_index_map": {params[0]: (0, 10, 0), params[1]: (64, 74, 0)},
        "params_with_extra_main_grads": [],
    }
    wanted = inspect.signature(pgb._ParamAndGradBucket.__init__).parameters
    kwargs = {k: v for k, v in offered.items() if k in wanted}
    missing = [k for k, p in wanted.items() if k != "self" and k not in kwargs and p.default is p.empty]
    if missing:
        raise RuntimeError(
            f"_ParamAndGradBucket.__init__ needs unknown arguments {missing}; cannot probe defect A"
        )
    bucket = pgb._ParamAndGradBucket(**kwargs)
    return tuple(bucket.param_to_index[params[1]]) == (64, 74)
