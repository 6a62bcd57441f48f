"""A small public kit for testing a training loop with the plugin on a laptop: real megatron-core
DDP + distributed optimizer over gloo, without Transformer Engine or a GPU.

It is here for users who want to check their own loop (train -> eval -> save -> train with
:func:`mbridge_mxfp8_plugin.mxfp8_param_sync`) against a reference before spending GPU hours;
``mxfp8-plugin demo`` is built on it. The plugin itself never imports it.

* ``cpu_shim`` -- a reversible context, active only without CUDA, under which megatron-core's
  ``device='cuda'`` code runs on CPU (streams and events stubbed, collectives real over gloo).
* ``emulated_mxfp8`` -- an emulated MXFP8 parameter type registered where megatron-core looks for
  Transformer Engine's, so core takes its MXFP8 code paths (and shows defects A, B and C).
  ``MXFP8_PARAM_KIND=te`` selects ``te_mxfp8`` instead: a param shaped like Transformer Engine's
  ``MXFP8Tensor`` (uint8 codes and E8M0 scales in both directions, a ``_quantizer``), so the
  Transformer Engine branches of core and of the plugin run too.
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
    mxfp8_reference_weight,
    param_kind,
)
from .launcher import RankFailed, launch
from .te_mxfp8 import (
    TEShapedMXFP8Quantizer,
    TEShapedMXFP8Tensor,
    TEShapedQuantizedTensor,
    make_te_mxfp8_param,
    te_shaped_mxfp8,
)

__all__ = [
    "EmulatedMXFP8Tensor",
    "EmulatedQuantizedTensor",
    "RankFailed",
    "TEShapedMXFP8Quantizer",
    "TEShapedMXFP8Tensor",
    "TEShapedQuantizedTensor",
    "cpu_shim",
    "emulated_mxfp8",
    "launch",
    "make_mxfp8_param",
    "make_te_mxfp8_param",
    "mxfp8_quantize",
    "mxfp8_reference_weight",
    "param_kind",
    "shim_needed",
    "te_shaped_mxfp8",
]
