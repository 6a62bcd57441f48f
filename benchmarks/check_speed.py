"""How long one ``mxfp8-plugin check RECIPE`` takes, as a user runs it: a fresh process each time.

    python benchmarks/check_speed.py [--runs 5] [--recipe recipes/llama3_8b_mxfp8_pretrain.yaml]

Median wall time of ``--runs`` cold processes (a new interpreter each; one untimed run first so
that Python's bytecode caches and check's summaries of the installed sources exist, as they do
after the first ``check``). Also the same with that summary cache off (``MXFP8_PLUGIN_CACHE=off``:
the first check after an upgrade), and, for scale, a bare interpreter and ``import omegaconf``
(the floor: Bridge's reader), and the load average and the process CPU time, because other jobs
on a small machine move every wall-clock number. Also records whether torch or megatron-core
was imported on the way (from ``-X importtime``), which must be never. Target: median <= 0.25 s.
Writes ``benchmarks/results/check_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: check on one file, whole process, median (issue 25).
TARGET_S = 0.25


def _time(cmd: list[str], env: dict[str, str], runs: int) -> dict[str, object]:
    subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False)  # warm the caches
    times, cpu = [], []
    rc = None
    for _ in range(runs):
        before = os.times()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
        after = os.times()
        cpu.append(
            after.children_user + after.children_system - before.children_user - before.children_system
        )
        rc = proc.returncode
    return {
        "median_s": round(statistics.median(times), 3),
        "runs_s": [round(t, 3) for t in times],
        "median_cpu_s": round(statistics.median(cpu), 3),
        "rc": rc,
    }


def _heavy_imports(cmd: list[str], env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    return sorted(n for n in names if n.split(".")[0] == "torch" or n.startswith("megatron.core"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--recipe", default="recipes/llama3_8b_mxfp8_pretrain.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "check_speed.json"))
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["NO_VCS_VERSION"] = "1"
    py = sys.executable
    check = [py, "-m", "mbridge_mxfp8_plugin.commands.cli", "check", args.recipe]
    load_before = os.getloadavg()
    result = {
        "recipe": args.recipe,
        "check": _time(check, env, args.runs),
        "check_with_overrides": _time([*check, "optimizer.lr=3e-4", "ddp.bucket_size=4e7"], env, args.runs),
        "check_no_summary_cache": _time(check, {**env, "MXFP8_PLUGIN_CACHE": "off"}, args.runs),
        "python_bare": _time([py, "-c", "pass"], env, args.runs),
        "import_omegaconf": _time([py, "-c", "import omegaconf"], env, args.runs),
        "heavy_imports": _heavy_imports(check, env),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = result["check"]["median_s"] <= TARGET_S and not result["heavy_imports"]  # type: ignore[index,operator]
    print(
        f"check: median {result['check']['median_s']} s (target <= {TARGET_S} s): {'PASS' if ok else 'FAIL'}"
    )  # type: ignore[index]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
