"""A job's first weight check on the host, side by side between two checkouts (issue 32: at 1B a
job's first fused 1/16 check cost 0.75-1.31x the eval transition on the H100 hosts, and most of
it was the plan's walk: 5.2 of 8.8 ms, about 40 us per param, spread over small host work).

The fused path's first check of a fresh plan (TE-shaped MXFP8 params, 120 params as in the 1B
job), at 1/16 and full, on the CPU with ``replay_head``'s stand-ins: the kernels launch nothing
(their host side is Triton's, not the plugin's) and the graph is "captured" by running its
recording once. What is timed is the plugin's host work: the walk (per-param geometry, readers,
batches), the probes' host side, the tables, the report. Triton's own start-up and compiles,
and the probe's device work, are not here (``verify_te`` measures the whole call on a GPU).
Each checkout runs in its own process, the two alternating.

    python benchmarks/first_call.py --before /tmp/old --label <rev> --out benchmarks/results/first_call

``--before`` is a directory holding an older ``mbridge_mxfp8_plugin`` (``git archive <rev>
mbridge_mxfp8_plugin | tar x -C /tmp/old``); the current one is this checkout's.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from _job import parts_main

SIZE = "256x60"  # 60 layers: the 1B job's 120 params (the host's work is per param, not per element)
SAMPLES = {"s16": 1 / 16, "full": 1.0}


def worker(calls: int) -> dict[str, Any]:
    """Median seconds of ``calls`` first checks of a fresh plan per sample (after 3 untimed)."""
    os.environ.update(TRITON_INTERPRET="1")
    import torch
    from verify_cold import cpu_check_job

    import mbridge_mxfp8_plugin
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.verify import weights

    torch.set_num_threads(1)  # no intra-op threads beside the timed one on a machine of few cores
    out: dict[str, Any] = {"plugin": str(Path(mbridge_mxfp8_plugin.__file__).parent)}
    with cpu_check_job(SIZE, os.environ.get("FIRST_CALL_PORT", "29573"), no_kernels=True) as (job, _):
        with torch._C.DisableTorchFunction():  # the CPU shim's mode is not in a GPU job
            for key, sample in SAMPLES.items():
                times = []
                for i in range(3 + calls):
                    weights._PLANS.clear()  # a job's first call: no layout, no plan, no probe
                    t0 = time.perf_counter()
                    report = verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)
                    t1 = time.perf_counter()
                    if not report.ok or not any("fused" in p for p in report.reference_paths):
                        raise SystemExit(f"not an ok fused check: {report.message()}")
                    if i >= 3:
                        times.append(t1 - t0)
                out[f"{key}_s"] = statistics.median(times)
    return out


def main() -> None:
    parts = {"s16_s": "1/16", "full_s": "full"}
    title = "a job's first fused check, host time, 120 params (CPU)"
    parts_main(__doc__ or "", "first_call", 6, ("calls", 40), lambda a: worker(*a), parts, (1e3, "ms"), title)


if __name__ == "__main__":
    main()
