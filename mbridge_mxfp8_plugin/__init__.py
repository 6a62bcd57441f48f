"""MXFP8 param-gather fixes for megatron-core / Megatron-Bridge.

Public API. Importing this package imports nothing heavy: each name below is loaded on first
use (PEP 562), so ``mxfp8-plugin check`` and ``doctor`` on a login node never pay for torch or
megatron-core. No name here imports Megatron-Bridge or Lightning (the Bridge callback is
duck-typed for Bridge's ``CallbackManager``); only the modules that need them do, when used:
``mbridge_mxfp8_plugin.lightning`` imports Lightning, and the launcher and the recipe helpers
(``launch``, ``recipes``, ``config.read``) import Bridge's ``pretrain``, recipes and OmegaConf
utilities when they run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AlignmentReport",
    "CoreBehaviour",
    "MXFP8AlignmentError",
    "MXFP8ConfigError",
    "MXFP8ParamSync",
    "MXFP8ParamSyncCallback",
    "MXFP8PluginError",
    "MXFP8UsageError",
    "ParamSyncEngine",
    "PluginOptions",
    "SyncStats",
    "check_bucket_alignment",
    "ensure_weights_current",
    "mxfp8_param_sync",
    "probe_core",
    "validate_config",
    "ValidationReport",
    "verify_weights",
    "WeightReport",
]

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_WHERE = {
    "AlignmentReport": "buckets",
    "check_bucket_alignment": "buckets",
    "CoreBehaviour": "probes",
    "probe_core": "probes",
    "MXFP8AlignmentError": "errors",
    "MXFP8ConfigError": "errors",
    "MXFP8PluginError": "errors",
    "MXFP8UsageError": "errors",
    "MXFP8ParamSyncCallback": "bridge",
    "MXFP8ParamSync": "api",
    "mxfp8_param_sync": "api",
    "ParamSyncEngine": "sync",
    "SyncStats": "sync",
    "PluginOptions": "options",
    "validate_config": "config.validate",
    "ValidationReport": "config.validate",
    "ensure_weights_current": "ensure",
    "verify_weights": "verify",
    "WeightReport": "verify",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .api import MXFP8ParamSync, mxfp8_param_sync
    from .bridge import MXFP8ParamSyncCallback
    from .buckets import AlignmentReport, check_bucket_alignment
    from .config.validate import ValidationReport, validate_config
    from .ensure import ensure_weights_current
    from .errors import MXFP8AlignmentError, MXFP8ConfigError, MXFP8PluginError, MXFP8UsageError
    from .options import PluginOptions
    from .probes import CoreBehaviour, probe_core
    from .sync import ParamSyncEngine, SyncStats
    from .verify import WeightReport, verify_weights


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
