"""The one defect table, and a probe of the installed megatron-core that reads its files.

``doctor`` renders this table, ``check`` (MX009) quotes it, the docs cite it. The file probe
answers the same questions as :func:`.upstream.probe_core` without importing torch or
megatron-core (~4 s on a small machine), so ``mxfp8-plugin check`` stays fast; the runtime
(callbacks, engine) always decides from the imported classes instead.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "DEFECTS",
    "TRAINING_DEFECTS",
    "CoreFiles",
    "Defect",
    "LoopStaging",
    "core_defects",
    "core_package_dir",
    "defects_present",
    "probe_core_files",
]


@dataclass(frozen=True)
class Defect:
    """One upstream defect: what breaks, where, and which release fixed it."""

    id: str
    #: One line, user-facing: what goes wrong in a training run.
    symptom: str
    #: Where upstream (module and function) the defect lives.
    where: str
    #: The release (and PR) that fixed it upstream.
    fixed_in: str


DEFECTS: dict[str, Defect] = {
    d.id: d
    for d in (
        Defect(
            "A",
            "bucket param_to_index ignores the 64-element param padding: the MXFP8 copy-back after the "
            "all-gather hands params their neighbours' values",
            "megatron-core distributed/param_and_grad_buffer.py, _ParamAndGradBucket.__init__",
            "megatron-core 0.17.0 (#3007)",
        ),
        Defect(
            "B1",
            "a forced (synchronous) param all-gather before eval/save does not write the gathered weights "
            "into the params: eval and saves see the previous iteration's weights",
            "megatron-core distributed/param_and_grad_buffer.py, _ParamAndGradBucketGroup.start_param_sync",
            "megatron-core 0.18.0 (_post_param_sync, #4563)",
        ),
        Defect(
            "B2",
            "the training loop does not stage the fp32 main params before its forced all-gather: the "
            "shared buffer still holds gradients, which become the weights wherever core writes them back",
            "megatron-bridge training/train.py, the eval and save blocks of train()",
            "megatron-bridge 0.5.0 for evals (#3727), 0.6.0 for every forced sync "
            "(with megatron-core 0.19.0's prepare_model_params_for_param_sync)",
        ),
        Defect(
            "C",
            "param_gather_dispatched stays set after a forced sync: the next training step skips gather, "
            "copy-back and re-zeroing (polluted gradients, stale weights); hidden in the interleaved "
            "pipeline schedule with align_param_gather=True, which re-dispatches every gather each step",
            "megatron-core distributed/param_and_grad_buffer.py, finish_param_sync",
            "megatron-core 0.19.0 (reset_param_sync_dispatch_state, #5487)",
        ),
        Defect(
            "E",
            "eval-only jobs (skip_train) keep the forward pre-hooks on: the first eval forward gathers the "
            "never-staged shared buffer over the loaded weights",
            "megatron-bridge training/train.py and megatron-core's forward pre-hook",
            "not fixed upstream",
        ),
    )
}


@dataclass(frozen=True)
class CoreFiles:
    """What the installed megatron-core does, read from its source files (nothing imported)."""

    #: Directory of the ``megatron/core`` package that was read.
    source: str
    #: ``_ParamAndGradBucket.__init__`` takes the buffer's padded ``param_index_map`` (A fixed).
    pads_bucket_offsets: bool
    #: ``_ParamAndGradBucketGroup._post_param_sync`` exists (B1 fixed).
    forced_sync_writes_back: bool
    #: ``DistributedDataParallel.reset_param_sync_dispatch_state`` exists (C fixed).
    has_dispatch_reset: bool
    #: ``DistributedOptimizer.prepare_model_params_for_param_sync`` exists.
    has_prepare_for_param_sync: bool
    #: ``DistributedDataParallelConfig.reuse_grad_buf_for_mxfp8_param_ag`` exists.
    has_reuse_knob: bool

    @property
    def defects(self) -> list[str]:
        """Core-side defects present (A, B1, C); B2 and E belong to the loop."""
        return core_defects(
            pads_bucket_offsets=self.pads_bucket_offsets,
            forced_sync_writes_back=self.forced_sync_writes_back,
            has_dispatch_reset=self.has_dispatch_reset,
        )


#: The defects a training run (not an eval-only job) can hit, in table order.
TRAINING_DEFECTS = ("A", "B1", "B2", "C")


def core_defects(
    *, pads_bucket_offsets: bool | None, forced_sync_writes_back: bool | None, has_dispatch_reset: bool | None
) -> list[str]:
    """The core-side defects (A, B1, C) that a megatron-core with these behaviours has.

    The one place this is decided: the file probe, ``doctor`` and the config check's installed
    stack all pass their probe results here. ``None`` (not probed) counts as not present.
    """
    fixed = {"A": pads_bucket_offsets, "B1": forced_sync_writes_back, "C": has_dispatch_reset}
    return [d for d, ok in fixed.items() if ok is False]


class LoopStaging(Protocol):
    """What :func:`defects_present` needs to know about a training loop (e.g. the installed
    Megatron-Bridge's, :class:`mbridge_mxfp8_plugin.upstream.BridgeLoopBehaviour`)."""

    @property
    def stages_before_eval(self) -> bool: ...

    @property
    def stages_before_every_forced_sync(self) -> bool: ...


def defects_present(core: CoreFiles, loop: LoopStaging | None) -> dict[str, bool]:
    """Every defect of :data:`DEFECTS` -> present in this stack.

    B2 is the loop's: present unless the loop stages the main params before *every* forced sync
    (Bridge 0.6); a loop that stages before evals only (Bridge 0.5) still saves gathered
    gradients, and with no Bridge installed any hand-written loop is assumed not to stage. E is
    in no release's fix list: an eval-only job never stages.
    """
    core_side = core.defects
    present = {d: d in core_side for d in ("A", "B1", "C")}
    present["B2"] = loop is None or not loop.stages_before_every_forced_sync
    present["E"] = True
    return {d: present[d] for d in DEFECTS}


def core_package_dir() -> Path | None:
    """``megatron/core`` of the installed megatron-core, found without importing it.

    ``megatron`` is a namespace package, so finding it executes no megatron-core code.
    """
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / "core"
        if (candidate / "distributed" / "param_and_grad_buffer.py").is_file():
            return candidate
    return None


def _class_body(text: str, name: str) -> str:
    m = re.search(rf"^class {re.escape(name)}\b", text, re.M)
    if not m:
        return ""
    nxt = re.search(r"^(class |def |@)", text[m.end() :], re.M)
    return text[m.start() : m.end() + nxt.start()] if nxt else text[m.start() :]


def _init_signature(class_body: str) -> str:
    m = re.search(r"def __init__\((.*?)\)\s*(->[^:]*)?:", class_body, re.S)
    return m.group(1) if m else ""


@functools.lru_cache(maxsize=4)
def probe_core_files(core_dir: str | None = None) -> CoreFiles | None:
    """Read the installed megatron-core's param-sync sources as text; None when not installed."""
    root = Path(core_dir) if core_dir else core_package_dir()
    if root is None:
        return None

    def read(rel: str) -> str:
        f = root / rel
        return f.read_text(encoding="utf-8", errors="replace") if f.is_file() else ""

    pgb = read("distributed/param_and_grad_buffer.py")
    ddp = read("distributed/distributed_data_parallel.py")
    dist_opt = read("optimizer/distrib_optimizer.py")
    ddp_cfg = read("distributed/distributed_data_parallel_config.py")
    bucket_init = _init_signature(_class_body(pgb, "_ParamAndGradBucket"))
    return CoreFiles(
        source=str(root),
        pads_bucket_offsets="param_index_map" in bucket_init,
        forced_sync_writes_back="def _post_param_sync(" in _class_body(pgb, "_ParamAndGradBucketGroup"),
        has_dispatch_reset="def reset_param_sync_dispatch_state(" in ddp,
        has_prepare_for_param_sync="def prepare_model_params_for_param_sync(" in dist_opt,
        has_reuse_knob="reuse_grad_buf_for_mxfp8_param_ag" in ddp_cfg,
    )
