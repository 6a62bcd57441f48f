"""Where a replayed check's time goes on the GPU's timeline: one profiled call, event by event,
and each kernel's time per call, from the chrome traces ``verify_te`` writes
(``VERIFY_PROFILE=<key> VERIFY_TRACE_DIR=<dir>``; each call marked ``verify_weights call``).

The host profile says what Python costs and the steady timings what a call costs; neither says
which of the two a call waits for. The timeline does: how long the host works before the first
launch, how long the GPU sits idle between a launch and its first kernel, what runs after the
big compare and before the verdict reaches the host. A trace written with ``VERIFY_TRACE_PYTHON=1``
(torch's Python tracer on: slower calls, so only for where the host's time goes) also holds the
Python functions; ``--python`` lists the plugin's, nested, on the same clock.

    python benchmarks/trace_timeline.py benchmarks/results/verify_te_launch_first/profiled/s16_fused.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path
from typing import Any

#: The span ``verify_te._profile`` wraps each profiled call in (one name for both ends).
CALL_MARK = "verify_weights call"
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(path: Path) -> list[dict[str, Any]]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def _gpu_of(calls: list[dict[str, Any]], i: int, gpu: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call ``i``'s GPU events: from its start to the next call's (its work may outlast its span)."""
    after = calls[i + 1]["ts"] if i + 1 < len(calls) else float("inf")
    return [e for e in gpu if calls[i]["ts"] <= e["ts"] < after]


def python_calls(events: list[dict[str, Any]], t0: float, end: float, prefix: str, least: float) -> list[str]:
    """The Python functions of ``prefix`` (a path part) in ``[t0, end]`` lasting ``least`` us or
    more, in time order, indented by how many of the shown ones enclose them."""
    calls = sorted(
        (e for e in events if e.get("cat") == "python_function" and prefix in e.get("name", "")
         and t0 <= e["ts"] <= end and e["dur"] >= least),
        key=lambda e: (e["ts"], -e["dur"]),
    )  # fmt: skip
    lines, open_ends = [], list[float]()
    for e in calls:
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        name = e["name"].split(prefix, 1)[-1].lstrip("/")
        lines.append(f"{e['ts'] - t0:8.1f} {e['dur']:7.1f}  {'  ' * len(open_ends)}{name[:80]}")
        open_ends.append(e["ts"] + e["dur"])
    return lines


def timeline(path: Path, call: int, python: str = "") -> str:
    """Call ``call``'s CUDA runtime calls and GPU events (microseconds from the call's start; a
    kernel's ``idle`` is the GPU's gap since the previous one ended), then every kernel's mean
    time per call over all calls."""
    events = _events(path)
    calls = sorted((e for e in events if e.get("name") == CALL_MARK and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu = sorted((e for e in events if e.get("cat") in _GPU), key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    if not calls:
        return f"{path}: no '{CALL_MARK}' spans"
    call = min(call, len(calls) - 1)
    lines = [f"{path.name}: {len(calls)} calls; call {call}, in us from its start"]
    mark = calls[call]
    t0, end = mark["ts"], mark["ts"] + mark["dur"]
    shown = [e for e in runtime if t0 <= e["ts"] <= end] + _gpu_of(calls, call, gpu)
    last_end = None
    for e in sorted(shown, key=lambda e: e["ts"]):
        idle = ""
        if e.get("cat") in _GPU:
            idle = f"idle {e['ts'] - last_end:6.1f}" if last_end is not None else "first GPU event"
            last_end = e["ts"] + e["dur"]
        lines.append(f"{e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e['cat']:12s} {idle:>15s}  {e['name'][:64]}")
    lines.append(f"{mark['dur']:8.1f}          the call returns")
    if python:
        shown_py = python_calls(events, t0, end, python, least=1.0)
        lines.append(f"Python functions of {python} (1 us or more), in us from the call's start:")
        lines += shown_py or ["  none in this trace (write it with VERIFY_TRACE_PYTHON=1)"]
    per: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for i in range(len(calls)):
        for e in _gpu_of(calls, i, gpu):
            per[e["name"][:64]] += e["dur"]
            count[e["name"][:64]] += 1
    lines.append("GPU time per call (mean over the calls), by kernel:")
    for name, total in per.most_common():
        lines.append(f"{total / len(calls):8.1f} us  x{count[name] / len(calls):4.1f}  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--call", type=int, default=3, help="which call's timeline (default 3: steady)")
    parser.add_argument(
        "--python",
        nargs="?",
        const="mbridge_mxfp8_plugin",
        default="",
        metavar="PATH_PART",
        help="also list the call's Python functions whose file path holds PATH_PART "
        "(default: the plugin's); needs a trace written with VERIFY_TRACE_PYTHON=1",
    )
    args = parser.parse_args()
    shown = []
    for path in args.traces:
        try:
            shown.append(timeline(path, args.call, args.python))
        except (OSError, EOFError, ValueError) as exc:  # JSONDecodeError and gzip's errors included
            parser.error(f"{path}: not a readable chrome trace ({type(exc).__name__}: {exc}); "
                         "write one with VERIFY_PROFILE=<key> VERIFY_TRACE_DIR=<dir>")  # fmt: skip
    print("\n\n".join(shown))


if __name__ == "__main__":
    main()
