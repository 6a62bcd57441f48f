"""The weight verifier's cost (``verify_weights``, what ``PluginOptions(verify_weights=True)`` runs
after every forced sync), right after an eval transition.

* :func:`measure_verify`, part of ``eval_sync.py worker`` (emulated-MXFP8 type): time per call,
  extra peak memory, memory left allocated afterwards (must be 0) and whether it found the weights
  right, with each quantizer, at the default block sample (``verify_*``) and at 1.0
  (``verify_full_*``).
* ``eval_sync.py verify`` / ``verify-worker`` (:func:`run_verify`, :func:`verify_worker`), on the
  TE-shaped type (``MXFP8_PARAM_KIND=te``): eval transition with the emulated and a one-pass cast,
  sampled and full check (first calls, CUDA-graph capture, steady replay), extra peak memory, the
  graphs' pool, and the full check's floor; writes ``verify_te.{json,csv,png}``.
"""

from __future__ import annotations

from typing import Any

from _casts import nothing, plain_quantizer
from _job import (
    allocated,
    peak_extra,
    timeit,
)

#: Issue 23's targets for the verifier on the TE-shaped type at 4B, with the one-pass cast.
VERIFY_TARGETS = {"sampled_vs_eval": 0.25, "full_vs_eval": 1.0, "sampled_peak_bytes": 64 << 20}


# ------------------------------------------------------ the verifier on the emulated type
def measure_verify(job: Any, reset: Any, transition: Any) -> dict[str, Any]:
    """The verifier after an eval transition, with the emulated (TE-rule) and the one-pass
    quantizer, at the default block sample (``verify_*``, what the option runs) and at 1.0
    (``verify_full_*``, every block): each run checks weights that the same quantizer wrote, so
    it must find them right."""
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE

    res: dict[str, Any] = {"verify_sample": DEFAULT_VERIFY_SAMPLE}
    for suffix, quant in (("", None), ("_plainquant", plain_quantizer)):
        with quant() if quant else nothing():
            reset()
            transition()  # the weights are current: what the option checks after an eval
            for kind, sample in (("verify", DEFAULT_VERIFY_SAMPLE), ("verify_full", 1.0)):

                def check(sample: float = sample) -> Any:
                    return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

                report = check()
                res[f"{kind}{suffix}_ok"] = report.ok
                res[f"{kind}{suffix}_params_checked"] = report.params_checked
                res[f"{kind}{suffix}_elements_checked"] = report.elements_checked
                res[f"{kind}{suffix}_s"] = timeit(check)
                before = allocated()
                res[f"{kind}{suffix}_peak_extra_bytes"] = peak_extra(check)
                res[f"{kind}{suffix}_persistent_bytes"] = int(allocated() - before)
    return res


# ------------------------------------------------------- the verifier on the TE-shaped type
