"""A small public kit for testing a training loop with the plugin on a laptop: real megatron-core
DDP + distributed optimizer over gloo, without Transformer Engine or a GPU.

It is here for users who want to check their own loop (train -> eval -> save -> train with
:func:`mbridge_mxfp8_plugin.mxfp8_param_sync`) against a reference before spending GPU hours;
``mxfp8-plugin demo`` is built on it. The plugin itself never imports it.

* ``cpu_shim`` -- a reversible context, active only without CUDA, under which megatron-core's
  ``device='cuda'`` code runs on CPU (streams and events stubbed, collectives real over gloo).
* ``emulated_mxfp8`` -- an emulated MXFP8 parameter type registered where megatron-core looks for
  Transformer Engine's, so core takes its MXFP8 code paths (and shows defects A, B and C).
* ``launcher`` -- ``launch(fn, world_size)`` runs a module-level function on N spawned ranks.
* ``toy`` -- a tiny model plus ``build_job`` (DDP + distributed optimizer in the reuse mode) and
  deterministic batches: the smallest job that exercises every bucket path.
* ``megatron_lm_loop`` -- ``train_step`` and ``evaluate`` in Megatron-LM's order (``training.py``),
  for a loop of your own around a ``toy`` job; the demo's loop is built on them.
The suite's own loop replicas, case runners and the patches that run Megatron-Bridge's and NeMo's
real stacks on CPU (they patch megatron-core internals, so they do not ship) live under
``tests/harness``, not here.
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
