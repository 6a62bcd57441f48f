"""A kept weight check's host time, warm and cold, on the CPU (issue 32: at 1B a sampled check
right after an eval transition costs more on the H100's host than back to back; docs/verify.md).

A replayed check is host work around one graph launch: the launch's address guard
(``_replay_early``), the layout's fingerprint, the verdict read (``finish``) and the call's own
bookkeeping. Each reads a few Python and C++ objects per param. Back to back they sit in the CPU's
caches; after an eval transition, which walks the same job's buffers and more, they do not, and
every read is a miss. This measures that walk, stage by stage, in three conditions interleaved in
rounds: back to back, after a 64 MiB write (caches evicted, nothing else changed) and after an eval
transition (the plugin's eval path, what a job runs before its check).

On the CPU, with two stand-ins documented here: the plan's graph is "captured" by running its
recording once and "replayed" by doing nothing (a GPU replay runs no Python, and its outputs keep
the recorded verdicts: the weights do not change between calls); the timed calls run with torch's
function modes off, since the CPU shim's mode (how megatron-core runs without CUDA here) would
otherwise sit in every tensor method, which a GPU job does not have. The device work is not
measured: this is the host's part only.

    python benchmarks/eval_sync.py verify-cold --size 256x60 --out benchmarks/results/verify_cold
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _job import eval_after_a_step, parse_size, prepared_job, pyplot
from verify_te import timed_parts

#: the stages timed inside one check, as ``(module, owner, name) -> label``; the rest is "other"
_STAGES: dict[tuple[str, str | None, str], str] = {
    ("weights", None, "_replay_early"): "launch guard and launch",
    ("weights", None, "unchanged"): "layout re-read",
    ("weights", None, "fingerprint"): "fingerprint",
    ("shard", "ShardCheck", "finish"): "verdict read and report",
}
_CONDITIONS = ("back to back", "caches evicted", "after an eval transition")


class _Replay:
    """A kept graph's replay on the CPU: nothing runs, its outputs keep the recorded verdicts."""

    def replay(self) -> None:
        pass


def _capture(record: Any, paths: Any = ()) -> tuple[_Replay, Any]:
    return _Replay(), record()


class _NoKernel:
    """A Triton kernel that launches nothing (its host side is Triton's, not the plugin's)."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def cpu_check_job(size: str, port: str, no_kernels: bool = False) -> Iterator[tuple[Any, Any]]:
    """A one-rank gloo job of ``size`` on the CPU, TE-shaped MXFP8 params, its weights current
    (an eval transition run), its check's graph stood in (``_capture``): ``(job, transition)``.
    ``no_kernels``: the kernels launch nothing (the side-by-side scripts time the plugin's host
    work alone). ``port``: the rendezvous's default (``MASTER_PORT`` wins), one per script, so
    two of them can run at once."""
    import torch

    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8
    from mbridge_mxfp8_plugin.verify import _gather_kernel, _te_rule_kernel, _values_kernel, graphs

    os.environ["MXFP8_PARAM_KIND"] = "te"
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    if no_kernels:
        for module in (_te_rule_kernel, _values_kernel, _gather_kernel):
            for name in ("kernel", "items_kernel", "compare_kernel"):
                if hasattr(module, name):
                    setattr(module, name, _NoKernel())
    torch.distributed.init_process_group("gloo")
    try:
        with cpu_shim(), emulated_mxfp8():
            job, engine = prepared_job(*parse_size(size))
            transition = eval_after_a_step(job, engine)
            transition()  # the weights are current: what the check is for
            # a graph is "captured" wherever the check lives (the CPU here), as on a GPU
            graphs.on_cuda, graphs.capture = (lambda tensor: True), _capture
            torch.cuda.is_current_stream_capturing = lambda: False
            yield job, transition
    finally:
        torch.distributed.destroy_process_group()


def measure(size: str, sample: float, calls: int, rounds: int) -> dict[str, Any]:
    import torch

    from mbridge_mxfp8_plugin import verify_weights

    out: dict[str, Any] = {"size": size, "sample": sample, "calls": calls, "rounds": rounds}
    with cpu_check_job(size, "29541") as (job, transition):
        out["params"] = sum(1 for _ in job.model[0].parameters())

        def check() -> Any:
            with torch._C.DisableTorchFunction():
                return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

        for _ in range(3):  # planned, recorded, replayed
            check()
        evict = torch.ones(16 << 20)  # 64 MiB, more than this CPU's last-level cache
        before = {
            _CONDITIONS[0]: lambda: None,
            _CONDITIONS[1]: lambda: evict.add_(1.0),
            _CONDITIONS[2]: transition,
        }
        seen: dict[str, dict[str, list[float]]] = {c: {} for c in _CONDITIONS}
        with timed_parts(_STAGES) as spent:
            _rounds(check, before, seen, spent, calls, rounds)
    out["median_us"] = {
        c: {label: statistics.median(v) * 1e6 for label, v in parts.items()} for c, parts in seen.items()
    }
    return out


def _rounds(
    check: Any,
    before: dict[str, Any],
    seen: dict[str, dict[str, list[float]]],
    spent: dict[str, float],
    calls: int,
    rounds: int,
) -> None:
    """``rounds`` rounds, each condition in turn for ``calls`` calls: each call's total and stages."""
    for _ in range(rounds):
        for condition, prepare in before.items():
            for _ in range(calls):
                prepare()
                spent.clear()
                t0 = time.perf_counter()
                report = check()
                total = time.perf_counter() - t0
                if not report.ok:
                    raise SystemExit(f"the check failed ({condition}): {report.message()}")
                parts = seen[condition]
                parts.setdefault("total", []).append(total)
                for label, s in spent.items():
                    parts.setdefault(label, []).append(s)
                parts.setdefault("other", []).append(total - sum(spent.values()))


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    seen = {label for parts in result["median_us"].values() for label in parts}
    labels = [label for label in [*_STAGES.values(), "other"] if label in seen]  # a stage never entered: none
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(_CONDITIONS)
    for label in labels:
        values = [result["median_us"][c].get(label, 0.0) for c in _CONDITIONS]
        ax.bar(_CONDITIONS, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("host time per check (us, medians)")
    ax.set_title(f"a kept 1/{round(1 / result['sample'])} check, {result['params']} params, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.size, 1.0 / args.stride, args.calls, args.rounds)
    (out / "verify_cold.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "verify_cold.png")
    base = result["median_us"][_CONDITIONS[0]]["total"]
    for condition in _CONDITIONS:
        parts = result["median_us"][condition]
        stages = ", ".join(f"{label} {v:.0f}" for label, v in parts.items() if label != "total")
        print(f"{condition:>26}: {parts['total']:6.0f} us ({parts['total'] / base:.1f}x)  [{stages}]")
    return 0
