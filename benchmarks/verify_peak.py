"""What is alive at the extra peak of a job's first weight check (issue 32's memory budget).

One rank on a CUDA device, the TE-shaped MXFP8 type written by the one-pass stand-in ("another
rule": the type's own write judges): for a full and a 1/16 check on a fresh plan, the extra peak
as ``torch.cuda.max_memory_allocated`` sees it, then the allocator's trace of the call replayed
to its peak, the live allocations there grouped by where the package (or the benchmark) made
them. Tells which buffers the batch budget must count, where the totals alone cannot.

    torchrun --nproc_per_node 1 benchmarks/verify_peak.py [--size 4B] > verify_peak.log
"""

from __future__ import annotations

import argparse
import collections
import os
from typing import Any

from _casts import one_pass_te
from _job import between_evals, parse_size, peak_extra, prepared_job, prestaged_transition, start_ranks


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """The trace's peak of live bytes (allocations less frees requested) and what was live there."""
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    return peak, at_peak


def where(event: dict[str, Any]) -> str:
    ours = ("mbridge", "benchmarks")
    frames = [f for f in event.get("frames", []) if any(o in f["filename"] for o in ours)]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:4])


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4B")
    args = parser.parse_args()
    os.environ["MXFP8_PARAM_KIND"] = "te"
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8
    from mbridge_mxfp8_plugin.verify import weights

    start_ranks()
    with cpu_shim(), emulated_mxfp8(), one_pass_te():
        job, engine = prepared_job(*parse_size(args.size))
        between_evals(engine)()
        prestaged_transition(job, engine)  # the weights are current: what the option checks
        for sample in (1.0, 1 / 16):

            def check(sample: float = sample) -> Any:
                return verify_weights(job.model, job.optimizer, event="peak", sample=sample)

            weights._PLANS.clear()  # a job's first call: plan, probes, eager run, recording
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
            extra = peak_extra(check)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            again = peak_extra(check)
            peak, live = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
            mib = extra / 2**20, again / 2**20
            print(f"{args.size} sample {sample}: extra peak {mib[0]:.1f} MiB (a replay: {mib[1]:.1f})")
            print(f"  trace peak {peak / 2**20:.1f} MiB, {len(live)} allocations live there")
            groups: collections.Counter[str] = collections.Counter()
            for event in live.values():
                groups[where(event)] += event["size"]
            for name, size in groups.most_common(8):
                print(f"  {size / 2**20:8.2f} MiB  {name}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
