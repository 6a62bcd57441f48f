"""Public import path of the Lightning callback (``from mbridge_mxfp8_plugin.lightning import ...``).

The callback lives in :mod:`mbridge_mxfp8_plugin.adapters.lightning`; this name stays so that users'
code and the docs keep one short path. Importing it imports Lightning.
"""

from .adapters.lightning import MXFP8ParamSyncLightningCallback

__all__ = ["MXFP8ParamSyncLightningCallback"]
