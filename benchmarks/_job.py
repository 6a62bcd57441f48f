"""What the benchmarks of ``eval_sync.py`` share: the model sizes, timing and memory helpers, the
job they measure (a toy model after one real step, its prepared engine), the all-gather counter,
and how a ``torchrun`` worker starts, measures each size and writes its JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The command every worker runs under ``torchrun`` (``eval_sync.py worker`` / ``verify-worker``).
CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_sync.py")
SIZES = {"125M": (1024, 120), "1B": (4096, 60), "4B": (8192, 60)}  # hidden, layers of [h, h]
DEFAULT_SIZES = "1B,4B"
REPS = 5


# ----------------------------------------------------------------------------------- timing
def sync() -> None:
    """Every rank's work done. The barrier only where there is a rank to wait for: on one GPU it
    aligned nothing and added about 40 us to every number (a sampled check's fixed cost is a few
    times that)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def timed(fn: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def timeit(fn: Any, setup: Any = None, reps: int = REPS) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up; ``setup`` runs untimed."""
    times = []
    for i in range(reps + 1):
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------- memory
def allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def peak_extra(fn: Any) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()  # not sync(): a barrier allocates its own small tensor
    return int(torch.cuda.max_memory_allocated() - base)


# -------------------------------------------------------------------------------------- job
def train_one_step(job: Any) -> None:
    """One step in megatron-core's loop order (Megatron-LM core_v0.16.1 training.py L1614-1647).

    The step is not measured, only its result; torch's Adam takes it one param at a time, since
    its default multi-tensor path holds temporaries the size of every moment at once, which put
    the 4B job past an 80 GB H100 (the states themselves fit)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mbridge_mxfp8_plugin.testing.toy import make_batches

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    if len(job.model[0].remove_forward_pre_hook_handles) > 0:  # stage only with pre-hooks on
        for opt in job.optimizer.chained_optimizers:
            if isinstance(opt, DistributedOptimizer):
                opt._copy_main_params_to_param_buffer()
    ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=0)
    job.model[0](x, y).backward()
    for chunk in job.model:
        chunk.finish_grad_sync()
    for opt in job.optimizer.chained_optimizers:  # torch's Adam: one param at a time (see below)
        for group in getattr(opt.optimizer, "param_groups", []):
            if "foreach" in group:
                group["foreach"] = False
    job.optimizer.step()


def prepared_job(hidden: int, layers: int, micro_batch_size: int = 4) -> tuple[Any, Any]:
    """``layers`` layers of ``[hidden, hidden]`` in the steady state (pre-hooks on, one real step
    behind us: the buffer holds reduced gradients), and its prepared engine."""
    from mbridge_mxfp8_plugin import ParamSyncEngine
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig(dims=(hidden,) * (layers + 1), micro_batch_size=micro_batch_size))
    train_one_step(job)
    engine = ParamSyncEngine(job.model, job.optimizer)
    engine.prepare()
    return job, engine


def between_evals(engine: Any) -> Callable[[], None]:
    """Stands in for a training step between two evals: the weights are no longer fresh and no
    group is left dispatched."""

    def reset() -> None:
        engine.step_started()
        for g in engine.bucket_groups():
            g.param_gather_dispatched = False

    return reset


def eval_after_a_step(job: Any, engine: Any) -> Callable[[], None]:
    """What a job runs before an eval's check: a training step's end (:func:`between_evals`),
    then the eval transition (:func:`prestaged_transition`)."""
    reset = between_evals(engine)

    def transition() -> None:
        reset()
        prestaged_transition(job, engine)

    return transition


def pyplot(path: Path) -> Any:
    """matplotlib's pyplot on its file backend, or None (said, with where the plot would go) where
    matplotlib is not installed: the results stand without their plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot at {path}")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def framework_forced_sync(job: Any) -> None:
    for chunk in job.model:
        chunk.start_param_sync(force_sync=True)


def prestaged_transition(job: Any, engine: Any) -> None:
    """The Bridge callback's eval path: stage at the step's end, the framework's forced gather,
    ``before_eval``'s write-back, ``after_forced_sync``."""
    engine.before_forced_sync()
    framework_forced_sync(job)
    engine.before_eval()
    engine.after_forced_sync()


class GatherCounter:
    """Counts all-gathers megatron-core issues (its buffer module binds the function at import)."""

    def __init__(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        self.pgb, self.orig, self.count = pgb, pgb.dist_all_gather_func, 0

        def counted(*a: Any, **k: Any) -> Any:
            self.count += 1
            return self.orig(*a, **k)

        pgb.dist_all_gather_func = counted

    def take(self) -> int:
        n, self.count = self.count, 0
        return n

    def restore(self) -> None:
        self.pgb.dist_all_gather_func = self.orig


# ------------------------------------------------------------------------------------ ranks
def parse_size(label: str) -> tuple[int, int]:
    """``1B`` etc. (:data:`SIZES`) or ``HIDDENxLAYERS``."""
    return SIZES[label] if label in SIZES else tuple(int(v) for v in label.split("x"))  # type: ignore[return-value]


def start_ranks() -> None:
    """This rank's GPU (where there is one) and the process group (NCCL, or gloo on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def measure_sizes(
    out: dict[str, Any], sizes: str, measure: Callable[[str, int, int], dict[str, Any]]
) -> None:
    """``measure(label, hidden, layers)`` of every size into ``out["sizes"]``; rank 0 prints each."""
    import torch

    for label in sizes.split(","):
        hidden, layers = parse_size(label)
        out["sizes"].append(measure(label, hidden, layers))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the size's job is gone with measure's frame
        if torch.distributed.get_rank() == 0:
            print(json.dumps(out["sizes"][-1]), flush=True)


def finish_ranks(out: dict[str, Any], json_path: str) -> None:
    import torch

    if torch.distributed.get_rank() == 0:
        Path(json_path).write_text(json.dumps(out, indent=2))
    torch.distributed.destroy_process_group()


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of one ``torchrun`` worker of :data:`CLI`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), CLI, *args]


def core_env(path: str, **extra: str) -> dict[str, str]:
    """The environment of a worker on the megatron-core install at ``path``."""
    return dict(
        os.environ,
        PYTHONPATH=f"{path}:{REPO}:{os.environ.get('PYTHONPATH', '')}",
        NO_VCS_VERSION="1",
        **extra,
    )


# ------------------------------------------------------------------------ two checkouts
def side_by_side(before: str, script: str, worker_args: list[str], rounds: int) -> dict[str, list[Any]]:
    """``script --worker *worker_args``'s JSON result against an older checkout (``before``: a
    directory holding an older ``mbridge_mxfp8_plugin``, made with ``git archive <rev>
    mbridge_mxfp8_plugin | tar x -C DIR``) and this one, each in its own process, the two
    alternating for ``rounds`` rounds, so that the machine's drift falls on both: per side, one
    result a round."""
    sides = {"before": str(Path(before).resolve()), "now": str(REPO)}
    seen: dict[str, list[Any]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, path in sides.items():
            env = dict(os.environ, PYTHONPATH=path, NO_VCS_VERSION="1")
            cmd = [sys.executable, script, "--worker", *worker_args]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            seen[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return seen


def compared(seen: dict[str, list[float]], label: str, scale: float, unit: str) -> list[float]:
    """Now over before per round of ``seen`` (side -> one value a round), printed on one line
    with each side's median (times ``scale``, in ``unit``)."""
    ratios = [now / before for now, before in zip(seen["now"], seen["before"], strict=True)]
    medians = {side: statistics.median(values) * scale for side, values in seen.items()}
    print(
        f"{label}: before {medians['before']:.1f} {unit}, now {medians['now']:.1f} {unit}, "
        "now / before per round " + ", ".join(f"{r:.2f}" for r in ratios)
    )
    return ratios


def sides_of_parts(
    args: argparse.Namespace, script: str, option: str, parts: dict[str, str], scale: float, unit: str
) -> dict[str, Any]:
    """A side-by-side script's ``run`` where each worker result holds seconds under ``parts``'
    keys (key -> label): per part, each side's value a round and now over before per round
    (printed in ``unit``, seconds times ``scale``). The worker gets ``args.<option>``."""
    runs = side_by_side(args.before, script, [str(getattr(args, option))], args.rounds)
    out: dict[str, Any] = {"before": args.label or args.before, "rounds": args.rounds}
    out[option] = getattr(args, option)
    out["plugin"] = {side: results[0]["plugin"] for side, results in runs.items()}
    for part, label in parts.items():
        seen = {side: [r[part] for r in results] for side, results in runs.items()}
        out[part] = {**seen, "now_over_before": compared(seen, label, scale, unit)}
    return out


def plot_parts(
    result: dict[str, Any], parts: dict[str, str], scale: float, ylabel: str, title: str, path: Path
) -> None:
    """``sides_of_parts``' result as before/now bars, one pair per part (medians of rounds)."""
    bars = {
        label: {side: statistics.median(result[part][side]) * scale for side in ("before", "now")}
        for part, label in parts.items()
    }
    plot_sides(bars, ylabel, title, path)


def parts_main(
    doc: str,
    name: str,
    rounds: int,
    option: tuple[str, int],
    worker: Callable[[list[int]], dict[str, Any]],
    parts: dict[str, str],
    unit: tuple[float, str],
    title: str,
) -> None:
    """``side_by_side_main`` for a script whose worker measures seconds under ``parts``' keys
    (key -> label), shown in ``unit`` (scale, name): ``sides_of_parts`` and ``plot_parts``."""
    scale, label = unit

    def run(args: argparse.Namespace) -> dict[str, Any]:
        return sides_of_parts(args, sys.argv[0], option[0], parts, scale, label)

    def plot(result: dict[str, Any], path: Path) -> None:
        plot_parts(result, parts, scale, f"{label} per call (median of rounds)", title, path)

    side_by_side_main(doc, name, rounds, run, plot, option, worker)


def side_by_side_main(
    doc: str,
    name: str,
    rounds: int,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    plot: Callable[[dict[str, Any], Path], None],
    option: tuple[str, int],
    worker: Callable[[list[int]], dict[str, Any]],
) -> None:
    """The command line of a side-by-side benchmark (``plan_tables.py``, ``replay_head.py``):
    ``--before DIR --label REV --out DIR --rounds N`` and the script's own integer ``option``
    (name, default); ``run``'s result goes to ``OUT/<name>.json`` and its plot to
    ``OUT/<name>.png``. ``--worker ARGS`` (how :func:`side_by_side` calls the script) prints
    ``worker(ARGS)`` as JSON instead."""
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker([int(a) for a in sys.argv[2:]])))
        return
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a directory holding the older mbridge_mxfp8_plugin")
    parser.add_argument("--label", default="", help="what --before is (its revision), for the results")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / name)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument(f"--{option[0]}", type=int, default=option[1])
    args = parser.parse_args()
    if not (Path(args.before) / "mbridge_mxfp8_plugin").is_dir():
        parser.error(f"--before {args.before}: no mbridge_mxfp8_plugin directory there")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{name}.png")


def plot_sides(bars: dict[str, dict[str, float]], ylabel: str, title: str, path: Path) -> None:
    """A bar per side (``before``, ``now``) for each label of ``bars`` (label -> side -> value)."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(bars)
    for i, side in enumerate(("before", "now")):
        values = [bars[label][side] for label in labels]
        ax.bar([x + (i - 0.5) * 0.35 for x in range(len(labels))], values, 0.35, label=side)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
