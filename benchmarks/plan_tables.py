"""A plan's kernel tables on the host, side by side between two checkouts (issue 32: a job's first
full check through a type's own write spends a third of its time making them at 4B).

``ShardCheck._plan_launches`` makes every batch's launch table as Python rows, groups an
own-write key's batches into templates and sends the tables to the device in one copy. Its cost
is per batch, and a full check of a 4B model is a few hundred to a few thousand own-write
batches. This times it alone, on the CPU (Triton's interpreter stands in for the device: the
tables are the same rows), for TE-shaped MXFP8 params whose batches the budget cuts small, so a
small model makes as many batches as a large one. Each checkout runs in its own process, the two
alternating, several rounds: the ratio is side by side on one machine.

    python benchmarks/plan_tables.py --before /tmp/old --label <rev> --out benchmarks/results/plan_tables

``--before`` is a directory holding an older ``mbridge_mxfp8_plugin`` (``git archive <rev>
mbridge_mxfp8_plugin | tar x -C /tmp/old``); the current one is this checkout's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _job import compared, plot_sides, side_by_side, side_by_side_main

#: (params of 64 x 512, batch budget in bytes): about 7,700 and 550 own-write batches
CASES = {"7.7k batches": (240, 12 << 10), "550 batches": (240, 256 << 10)}


def worker(params: int, budget: int, reps: int) -> dict[str, Any]:
    """Seconds of ``_plan_launches`` for a fresh plan, ``reps`` times (the collector off while
    timed, as a check runs with it off)."""
    import gc

    os.environ.update(TRITON_INTERPRET="1", MXFP8_VERIFY_TRITON="1", MXFP8_VERIFY_FUSED="0")
    import torch

    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
    from mbridge_mxfp8_plugin.verify import graphs, shard
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.report import WeightReport

    graphs.on_cuda = lambda tensor: True  # a template is made only where a graph could be
    quantizer = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(64, 512, generator=gen).to(torch.bfloat16) for _ in range(params)]
    made = [(f"p{i}", quantizer.quantize(v), v.float().reshape(-1)) for i, v in enumerate(values)]
    times, batches = [], 0
    for _ in range(reps):
        check = shard.ShardCheck(WeightReport(event="t"), atol=0.0, stride=1, offset=0, budget_bytes=budget)
        for name, param, main in made:
            check.add(
                name, param, reader_for(param), Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True
            )
        for key in list(check.batches):
            check._seal(key)
        batches = len(check.planned)
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        check._plan_launches()
        times.append(time.perf_counter() - t0)
        gc.enable()
    return {"batches": batches, "median_s": statistics.median(times), "times_s": times}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "cases": {},
        "rounds": args.rounds,
        "reps": args.reps,
        "before": args.label or args.before,
    }
    for case, (params, budget) in CASES.items():
        worker_args = [str(params), str(budget), str(args.reps)]
        runs = side_by_side(args.before, __file__, worker_args, args.rounds)
        seen = {side: [r["median_s"] for r in results] for side, results in runs.items()}
        batches = runs["now"][-1]["batches"]
        ratios = compared(seen, f"{case} ({batches} batches)", 1e3, "ms")
        out["cases"][case] = {"batches": batches, "median_s": seen, "now_over_before": ratios}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    bars = {
        case: {side: statistics.median(seen["median_s"][side]) * 1e3 for side in ("before", "now")}
        for case, seen in result["cases"].items()
    }
    plot_sides(bars, "ms per plan (median of rounds)", "a plan's kernel tables on the host (CPU)", path)


def main() -> None:
    side_by_side_main(__doc__ or "", "plan_tables", 3, run, plot, ("reps", 5), lambda args: worker(*args))


if __name__ == "__main__":
    main()
