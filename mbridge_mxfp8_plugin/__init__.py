"""MXFP8 param-gather fixes for megatron-core / Megatron-Bridge.

Public API. Importing this package imports neither Megatron-Bridge nor Lightning; megatron-core
is imported lazily, when a callback first sees a model.
"""

from .bridge import MXFP8ParamSyncCallback
from .buckets import AlignmentReport, check_bucket_alignment
from .errors import MXFP8AlignmentError, MXFP8ConfigError, MXFP8PluginError, MXFP8UsageError
from .sync import ParamSyncEngine, SyncStats
from .upstream import CoreBehaviour, probe_core
from .validate import ValidationReport, validate_config

__all__ = [
    "AlignmentReport",
    "CoreBehaviour",
    "MXFP8AlignmentError",
    "MXFP8ConfigError",
    "MXFP8ParamSyncCallback",
    "MXFP8PluginError",
    "MXFP8UsageError",
    "ParamSyncEngine",
    "SyncStats",
    "check_bucket_alignment",
    "probe_core",
    "validate_config",
    "ValidationReport",
]

__version__ = "0.1.0"
