"""Test and demo support: run real megatron-core DDP + distributed optimizer without TE or GPUs.

Public so that users can reproduce the defects and the fix on a laptop. Nothing here is imported
by the plugin itself.
"""

from .cpu_shim import cpu_shim, shim_needed
from .emulated_mxfp8 import (
    EmulatedMXFP8Tensor,
    EmulatedQuantizedTensor,
    emulated_mxfp8,
    make_mxfp8_param,
    mxfp8_quantize,
)
from .launcher import RankFailed, launch

__all__ = [
    "EmulatedMXFP8Tensor",
    "EmulatedQuantizedTensor",
    "RankFailed",
    "cpu_shim",
    "emulated_mxfp8",
    "launch",
    "make_mxfp8_param",
    "mxfp8_quantize",
    "shim_needed",
]
