"""Known hazards around MXFP8 reuse that the plugin cannot repair, probed in the installed files.

Each answer comes from the code that decides the behaviour (the method that holds a fix, the
validation that rejects a combination), never from a version string: a vendor backport counts
as fixed, a regression is not masked. Read as text, like :mod:`.core` and :mod:`.loops`, so
``check`` and ``doctor`` pay no torch / megatron-core / Bridge import. ``None`` everywhere means
"that package is not installed, or the code that decides it was not found".
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..common.records import record
from ._source import block, read_text
from .core import core_package_dir
from .loops import bridge_training_dir

__all__ = ["HazardBehaviour", "probe_hazard_files"]


@record
class HazardBehaviour:
    """What the installed releases do about the hazards of :data:`...defects.HAZARDS`."""

    #: ``ChainedOptimizer`` defers the MXFP8 param sync until every chained optimizer stepped,
    #: so the expert optimizer's sync cannot zero a shard the dense one has not staged yet
    #: (Megatron-LM #4800, megatron-core 0.18.0).
    defers_chained_mxfp8_sync: bool | None
    #: ``OptimizerConfig.__post_init__`` raises for ``overlap_param_gather_with_optimizer_step``
    #: with ``reuse_grad_buf_for_mxfp8_param_ag`` (megatron-core 0.19.0).
    rejects_step_overlap_with_reuse: bool | None
    #: ``optimizer_cpu_offload`` forces the precision-aware optimizer path, which hands the
    #: optimizer ``None`` for every FP8 param shard (Megatron-LM #5083, open).
    cpu_offload_drops_fp8_params: bool | None
    #: Bridge's loop stages the main params before a captured full-iteration CUDA graph replays
    #: its all-gather, also on the first iteration (Megatron-Bridge #3076, Bridge 0.5.0).
    stages_for_full_iteration_graph: bool | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: A method of ``ChainedOptimizer`` whose name says it defers the MXFP8 param sync.
_DEFER = re.compile(r"def _?\w*defer\w*mxfp8\w*\(|def _?\w*mxfp8\w*defer\w*\(")
_REJECTS = re.compile(
    r"if [^\n]*(reuse_grad_buf_for_mxfp8_param_ag[^\n]*overlap_param_gather_with_optimizer_step"
    r"|overlap_param_gather_with_optimizer_step[^\n]*reuse_grad_buf_for_mxfp8_param_ag)[^\n]*:\s*\n\s*raise"
)
_NO_FP8_FLAG = re.compile(
    r"self\.use_precision_aware_optimizer_no_fp8_or_ds_fp8\s*=\s*\((.*?)\n\s*\)\n", re.S
)


def _core_answers(root: Path) -> tuple[bool | None, bool | None, bool | None]:
    chained = block(read_text(root, "optimizer/optimizer.py"), "class", "ChainedOptimizer")
    config = read_text(root, "optimizer/optimizer_config.py")
    flag = _NO_FP8_FLAG.search(config)
    drops = None
    if flag:  # offload in the flag's OR, not qualified by fp8_param_gather (PR #2788's proposal)
        drops = "optimizer_cpu_offload" in flag.group(1) and "fp8_param_gather" not in flag.group(1)
    return (
        bool(_DEFER.search(chained)) if chained else None,
        bool(_REJECTS.search(config)) if config else None,
        drops,
    )


def _bridge_stages_for_graph(training: Path) -> bool | None:
    """Does Bridge's per-step staging (``_handle_mxfp8_param_buffer_copy``, which skips the copy
    while the forward pre-hooks are off) stage anyway once a full-iteration graph was captured?

    Only that function decides what the first graphed step gathers: other stagers (0.5's explicit
    staging before evals) run around forced syncs, outside any captured graph.
    """
    stager = block(read_text(training, "train.py"), "def", "_handle_mxfp8_param_buffer_copy")
    if not stager:
        return None
    return "FullCudaGraphWrapper.cuda_graph" in stager


@functools.lru_cache(maxsize=4)
def probe_hazard_files(core_dir: str | None = None, bridge_training: str | None = None) -> HazardBehaviour:
    """Read the installed megatron-core and Megatron-Bridge (or the given directories)."""
    core = Path(core_dir) if core_dir else core_package_dir()
    training = Path(bridge_training) if bridge_training else bridge_training_dir()
    defers, rejects, drops = _core_answers(core) if core else (None, None, None)
    return HazardBehaviour(
        defers_chained_mxfp8_sync=defers,
        rejects_step_overlap_with_reuse=rejects,
        cpu_offload_drops_fp8_params=drops,
        stages_for_full_iteration_graph=_bridge_stages_for_graph(training) if training else None,
    )
