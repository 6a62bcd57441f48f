"""A replayed check's host time before its graph launch, side by side between two checkouts
(issue 32: at 1B the fused path's sampled check is a fixed cost, and the host's work before the
launch is the part the GPU waits for; what comes after overlaps the compares).

A kept 1/16 check of the fused path (TE-shaped MXFP8 params, 120 params as in the 1B job), on the
CPU with ``verify_cold``'s stand-ins: the graph is "captured" by running its recording once and
"replayed" by doing nothing (a GPU replay runs no Python), and the kernels launch nothing (their
host side is Triton's, not the plugin's). Timed per call: from ``verify_weights``' entry to the
replay (the head) and in all. Each checkout runs in its own process, the two alternating.

    python benchmarks/replay_head.py --before /tmp/old --label <rev> --out benchmarks/results/replay_head

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


def worker(calls: int) -> dict[str, Any]:
    """Median head and total of ``calls`` replayed checks (after a warm-up of 100)."""
    os.environ.update(TRITON_INTERPRET="1")
    import torch
    from verify_cold import cpu_check_job

    import mbridge_mxfp8_plugin
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.verify import shard

    torch.set_num_threads(1)  # no intra-op threads beside the timed one on a machine of few cores
    with cpu_check_job(SIZE, os.environ.get("REPLAY_HEAD_PORT", "29571"), no_kernels=True) as (job, _):
        launched: list[float] = []
        replay = shard.ShardCheck._replay

        def timed_replay(self: Any) -> None:
            launched.append(time.perf_counter())
            replay(self)

        shard.ShardCheck._replay = timed_replay  # type: ignore[method-assign]
        heads, totals = [], []
        with torch._C.DisableTorchFunction():  # the CPU shim's mode is not in a GPU job
            for i in range(100 + calls):
                del launched[:]
                t0 = time.perf_counter()
                report = verify_weights(job.model, job.optimizer, event="benchmark", sample=1 / 16)
                t1 = time.perf_counter()
                if not report.ok or not launched:
                    raise SystemExit(f"not a replayed ok check: {report.message()}")
                if i >= 100:
                    heads.append(launched[0] - t0)
                    totals.append(t1 - t0)
    return {
        "plugin": str(Path(mbridge_mxfp8_plugin.__file__).parent),
        "head_s": statistics.median(heads),
        "total_s": statistics.median(totals),
    }


def main() -> None:
    parts = {"head_s": "before the launch", "total_s": "in all"}
    title = "a kept 1/16 check's host time, 120 params (CPU)"
    rounds, calls = 8, ("calls", 3000)
    parts_main(__doc__ or "", "replay_head", rounds, calls, lambda a: worker(*a), parts, (1e6, "us"), title)


if __name__ == "__main__":
    main()
