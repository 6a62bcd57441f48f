"""MXFP8 param-gather fixes for megatron-core / Megatron-Bridge.

Public API. Importing this package imports nothing heavy: each name below is loaded on first
use (PEP 562), so ``mxfp8-plugin check`` and ``doctor`` on a login node never pay for torch or
megatron-core. No name here imports Megatron-Bridge or Lightning (the Bridge callback is
duck-typed for Bridge's ``CallbackManager``); only the modules that need them do, when used:
``mbridge_mxfp8_plugin.lightning`` imports Lightning, and the launcher and the recipe helpers
(``launch``, ``recipes``, ``config.read``) import Bridge's ``pretrain``, recipes and OmegaConf
utilities when they run.

The package's rooms (docs/architecture.md draws them): ``mcore`` reads megatron-core's objects,
``engine`` decides and runs the param sync, ``verify`` checks the weights beside it, ``config`` and
``probes`` judge configs and installed releases, ``adapters`` join the engine to Bridge, Lightning and
a hand-written loop, ``commands`` are the CLI. The few modules at this level are the public face:
``errors``, ``options``, and the import paths users write (``lightning``, ``recipes``, ``launch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common.lazy import lazy_names

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
    "AlignmentReport": "mcore.buckets",
    "check_bucket_alignment": "mcore.buckets",
    "CoreBehaviour": "probes",
    "probe_core": "probes",
    "MXFP8AlignmentError": "errors",
    "MXFP8ConfigError": "errors",
    "MXFP8PluginError": "errors",
    "MXFP8UsageError": "errors",
    "MXFP8ParamSyncCallback": "adapters.bridge",
    "MXFP8ParamSync": "adapters.loop",
    "mxfp8_param_sync": "adapters.loop",
    "ParamSyncEngine": "engine.sync",
    "SyncStats": "engine.sync",
    "PluginOptions": "options",
    "validate_config": "config.validate",
    "ValidationReport": "config.validate",
    "ensure_weights_current": "engine.ensure",
    "verify_weights": "verify",
    "WeightReport": "verify",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .adapters.bridge import MXFP8ParamSyncCallback
    from .adapters.loop import MXFP8ParamSync, mxfp8_param_sync
    from .config.validate import ValidationReport, validate_config
    from .engine.ensure import ensure_weights_current
    from .engine.sync import ParamSyncEngine, SyncStats
    from .errors import MXFP8AlignmentError, MXFP8ConfigError, MXFP8PluginError, MXFP8UsageError
    from .mcore.buckets import AlignmentReport, check_bucket_alignment
    from .options import PluginOptions
    from .probes import CoreBehaviour, probe_core
    from .verify import WeightReport, verify_weights


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
