"""Are the model's weights what the optimizer says they are? A read-only check.

No framework checks that the MXFP8 params a model computes with come from the fp32 main params
the distributed optimizer holds. Megatron's ``check_param_hashes_across_dp_replicas`` compares
replicas only, so weights that are stale on every replica alike (defect B, or an export right
after an optimizer step) pass it. :func:`verify_weights` checks both:

* **shard check** (``shard``, no collective): each rank takes the params it owns a shard of and
  compares sampled 32-element blocks of each, by value, with the main shard sent through the
  path a param sync takes: rounded to the param buffer's dtype, then written into a small
  instance of the param's own type by the function the installed megatron-core writes gathered
  values with (``reference``), so every MXFP8 type is judged by its own rule. Params holding
  codes and scales (Transformer Engine's shape) are decoded block by block (``read``), never
  dequantized whole. A type the check cannot reproduce or read is ``unchecked``, never wrong.
* **replica check** (``replica``, one small all-reduce per data-parallel group): a 64-bit fold
  of the bits of every param, so every rank learns which params disagree between replicas and
  whether any peer's shard check failed.

The check writes nothing; making the weights current is
:func:`~mbridge_mxfp8_plugin.ensure_weights_current`'s job (in :mod:`~mbridge_mxfp8_plugin.engine.ensure`,
beside the engine's other users). Cost and limits: docs/verify.md.
"""

from __future__ import annotations

from .report import ParamMismatch, WeightReport
from .weights import verify_weights

__all__ = ["ParamMismatch", "WeightReport", "verify_weights"]
