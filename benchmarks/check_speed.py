"""What one ``mxfp8-plugin check RECIPE`` costs, as a ratio to its floor, measured side by side.

    python benchmarks/check_speed.py [--runs 15] [--recipe recipes/llama3_8b_mxfp8_pretrain.yaml]

``check`` is a fresh process per call (a login node, a CI step), and most of that process is
Python starting and importing the readers Bridge itself uses (OmegaConf, PyYAML): the floor is
``python -c "import omegaconf, yaml"``. Each round runs the floor and every ``check`` variant
once, in an order that rotates between rounds, so that the load of other jobs on a small shared
machine falls on all of them alike; the figure is the ratio of medians (wall time, and the
process's CPU time, which load moves less). One untimed round first, so that bytecode caches and
check's summaries of the installed sources exist, as they do after the first ``check``. Also
records whether torch or megatron-core was imported on the way (``-X importtime``), which must be
never, and ``check_with_teardown``: the same check ending in a normal interpreter exit, which shows
what ``cli.leave`` (no module teardown where nothing waits for it) saves. Goal: ``check`` / floor
<= 1.3 (issue 30). Writes ``benchmarks/results/check_speed.json``.
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
#: check on one file over ``import omegaconf, yaml``, ratio of medians (issue 30)
GOAL_RATIO = 1.3

#: ``check`` through ``cli.main`` and a normal interpreter exit (the console script skips teardown).
_MAIN_WITH_TEARDOWN = "import sys; from mbridge_mxfp8_plugin.commands.cli import main; sys.exit(main())"


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, CPU s of the child, exit status) of one cold process."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=False)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return wall, cpu, proc.returncode


def _heavy_imports(cmd: list[str], env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    return sorted(n for n in names if n.split(".")[0] == "torch" or n.startswith("megatron.core"))


Commands = dict[str, tuple[list[str], dict[str, str]]]


def measure(commands: Commands, rounds: int) -> dict[str, dict[str, object]]:
    """Every command once per round, rotated; per command its runs and medians."""
    names = list(commands)
    for name in names:  # warm: bytecode caches, check's source summaries
        _run(*commands[name])
    runs: dict[str, list[tuple[float, float, int]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(_run(*commands[name]))
    return {
        name: {
            "median_s": round(statistics.median(w for w, _, _ in got), 4),
            "median_cpu_s": round(statistics.median(c for _, c, _ in got), 4),
            "runs_s": [round(w, 4) for w, _, _ in got],
            "rc": got[-1][2],
        }
        for name, got in runs.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=15, help="rounds (each runs every command once)")
    parser.add_argument("--recipe", default="recipes/llama3_8b_mxfp8_pretrain.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "check_speed.json"))
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["NO_VCS_VERSION"] = "1"
    py = sys.executable
    check = [py, "-m", "mbridge_mxfp8_plugin", "check", args.recipe]
    commands = {
        "floor": ([py, "-c", "import omegaconf, yaml"], env),
        "check": (check, env),
        "check_with_overrides": ([*check, "optimizer.lr=3e-4", "ddp.bucket_size=40000000"], env),
        "check_no_summary_cache": (check, {**env, "MXFP8_PLUGIN_CACHE": "off"}),
        # the same work ending in a normal interpreter exit (module teardown), not cli.leave's
        "check_with_teardown": (
            [py, "-c", _MAIN_WITH_TEARDOWN, *check[3:]],
            env,
        ),
        "python_bare": ([py, "-c", "pass"], env),
    }
    load_before = os.getloadavg()
    timed = measure(commands, args.runs)
    floor = timed["floor"]
    ratios = {
        name: {
            "wall": round(float(t["median_s"]) / float(floor["median_s"]), 3),  # type: ignore[arg-type]
            "cpu": round(float(t["median_cpu_s"]) / float(floor["median_cpu_s"]), 3),  # type: ignore[arg-type]
        }
        for name, t in timed.items()
        if name != "floor"
    }
    result = {
        "recipe": args.recipe,
        "rounds": args.runs,
        "goal_ratio": GOAL_RATIO,
        "ratio_to_floor": ratios,
        **timed,
        "heavy_imports": _heavy_imports(check, env),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    ok = ratios["check"]["wall"] <= GOAL_RATIO and not result["heavy_imports"]
    check = ratios["check"]
    print(f"check / floor: {check['wall']} wall, {check['cpu']} CPU (goal <= {GOAL_RATIO})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
