"""Probes: what the installed megatron-core already does right.

Every decision the plugin takes comes from behaviour found here, never from a version string:
a backported fix in a vendor build is honoured, and an unreleased regression is not masked.
Defect A is a property of a live model's buckets and is repaired in :mod:`.buckets`;
:func:`probe_bucket_offsets` tests the installed class on a dummy bucket (for ``doctor``).
Megatron-Bridge's loop order (defect B2) is read from the installed Bridge sources as text
(:func:`probe_bridge_files`, importing Bridge needs Transformer Engine) or from the live
``megatron.bridge.training.train`` module (:func:`probe_live_bridge_loop`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "BridgeLoopBehaviour",
    "CoreBehaviour",
    "installed_versions",
    "probe_bridge_files",
    "probe_bucket_offsets",
    "probe_core",
    "probe_live_bridge_loop",
    "probe_live_loop",
]


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
        has_dispatch_reset=callable(
            getattr(DistributedDataParallel, "reset_param_sync_dispatch_state", None)
        ),
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
    index_map = {params[0]: (0, 10, 0), params[1]: (64, 74, 0)}
    grad = torch.zeros(128)
    offered: dict[str, Any] = {
        "params": params,
        "param_data": None,
        "grad_data": grad,
        "offset": 0,
        "numel_unpadded": 74,
        "gradient_scaling_factor": 1.0,
        "bucket_id": 0,
        "param_index_map": index_map,
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


@dataclass(frozen=True)
class BridgeLoopBehaviour:
    """What a Megatron-Bridge ``train()`` loop does around forced param syncs (from its source)."""

    source: str
    #: main params staged into the shared buffer before the eval's forced sync (B2 handled for
    #: evals): 0.5's explicit ``_copy_main_params_to_param_buffer`` or 0.6's optimizer-aware disable.
    stages_before_eval: bool
    #: staged before every forced sync: evals, saves, weight-hash checks, the closing disable (0.6+).
    stages_before_every_forced_sync: bool
    #: on_train_start fires before the initial ``disable_forward_pre_hook(param_sync=False)`` (0.4+).
    on_train_start_before_initial_disable: bool | None = None
    #: on_eval_start fires inside ``evaluate()`` after ``model.eval()`` (0.6+).
    on_eval_start_after_model_eval: bool | None = None
    #: ``on_checkpoint_save`` exists (0.5+); it fires after the save, never before.
    fires_on_checkpoint_save: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _function_body(text: str, name: str) -> str:
    """Source text of top-level ``def name(`` up to the next top-level ``def``/``class``."""
    m = re.search(rf"^def {re.escape(name)}\(", text, re.M)
    if not m:
        return ""
    nxt = re.search(r"^(def |class |@)", text[m.end() :], re.M)
    return text[m.start() : m.end() + nxt.start()] if nxt else text[m.start() :]


def bridge_training_dir() -> Path | None:
    """``megatron/bridge/training`` of the installed Megatron-Bridge (found without importing it)."""
    spec = importlib.util.find_spec("megatron")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / "bridge" / "training"
        if (candidate / "train.py").is_file():
            return candidate
    return None


def probe_bridge_files(training_dir: str | Path | None = None) -> BridgeLoopBehaviour | None:
    """Read the installed Megatron-Bridge ``training/{train,eval,callbacks}.py`` as text.

    Never imports Bridge. Returns None when no Bridge is installed.
    """
    root = Path(training_dir) if training_dir else bridge_training_dir()
    if root is None or not (root / "train.py").is_file():
        return None

    def read(name: str) -> str:
        f = root / name
        return f.read_text(encoding="utf-8", errors="replace") if f.is_file() else ""

    train_py, eval_py, cb_py = read("train.py"), read("eval.py"), read("callbacks.py")
    train_fn = _function_body(train_py, "train")
    disable_fn = _function_body(train_py, "disable_forward_pre_hook")
    force_fn = _function_body(train_py, "force_param_sync")
    optimizer_disable = "prepare_model_params_for_param_sync" in disable_fn
    optimizer_force = "prepare_model_params_for_param_sync" in force_fn
    saves_stage = bool(re.search(r"force_param_sync\(\s*model\s*,\s*optimizer", train_py))
    eval_disable_stages = optimizer_disable and bool(
        re.search(r"disable_forward_pre_hook\(\s*model\s*,\s*optimizer", train_fn)
    )
    explicit_eval_staging = "_copy_main_params_to_param_buffer" in train_fn
    ots = train_fn.find('"on_train_start"')
    first_disable = train_fn.find("disable_forward_pre_hook(model, param_sync=False)")
    eval_body = _function_body(eval_py, "evaluate")
    fired = re.search(r"fire\(\s*start_event\b", eval_body)
    start_at = fired.start() if fired else -1
    eval_at = eval_body.find(".eval()")
    return BridgeLoopBehaviour(
        source=str(root),
        stages_before_eval=explicit_eval_staging or eval_disable_stages,
        stages_before_every_forced_sync=(
            optimizer_disable and optimizer_force and saves_stage and eval_disable_stages
        ),
        on_train_start_before_initial_disable=(
            (ots < first_disable) if ots >= 0 and first_disable >= 0 else None
        ),
        on_eval_start_after_model_eval=(start_at > eval_at >= 0) if eval_body else None,
        fires_on_checkpoint_save=('"on_checkpoint_save"' in cb_py) if cb_py else None,
    )


_BRIDGE_TRAIN_MODULE = "megatron.bridge.training.train"
#: Megatron-LM's own loop (``pretrain_gpt.py`` -> ``megatron.training.training.train``).
_MEGATRON_LM_TRAIN_MODULE = "megatron.training.training"


def _module_stages_before_forced_syncs(name: str) -> bool | None:
    """Whether the loaded loop module ``name`` hands the optimizer to its forced-sync helpers.

    Megatron-Bridge >= 0.6 and Megatron-LM core_v0.19 give ``force_param_sync`` and
    ``disable_forward_pre_hook`` an ``optimizer`` argument and call
    ``optimizer.prepare_model_params_for_param_sync()`` before the forced all-gather (Megatron-LM
    core_v0.19.0 training.py L3014-3024). None when the module is not loaded.
    """
    mod = sys.modules.get(name)
    if mod is None:
        return None
    try:
        params = [
            inspect.signature(getattr(mod, helper)).parameters
            for helper in ("force_param_sync", "disable_forward_pre_hook")
        ]
    except (AttributeError, TypeError, ValueError):
        return None
    return all("optimizer" in p for p in params)


def probe_live_bridge_loop() -> bool | None:
    """Does the running Bridge loop stage main params before every forced param sync itself?

    Looks at the already imported ``megatron.bridge.training.train`` (Bridge's ``pretrain`` imports
    it; nothing is imported here): Bridge >= 0.6 passes the optimizer to ``force_param_sync`` and
    ``disable_forward_pre_hook``, which then call ``optimizer.prepare_model_params_for_param_sync()``
    before the forced all-gather. Returns None when no Bridge loop is loaded.
    """
    return _module_stages_before_forced_syncs(_BRIDGE_TRAIN_MODULE)


def probe_live_loop() -> bool | None:
    """Does a loaded training loop (Megatron-Bridge's or Megatron-LM's) stage before every forced
    sync itself? True if either does, False if one is loaded and does not, None if neither is."""
    answers = [
        _module_stages_before_forced_syncs(name) for name in (_BRIDGE_TRAIN_MODULE, _MEGATRON_LM_TRAIN_MODULE)
    ]
    if any(a is True for a in answers):
        return True
    return False if any(a is False for a in answers) else None
