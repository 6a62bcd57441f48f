"""``mxfp8-plugin demo``: the defects and the fix, side by side, on CPU in about a minute.

One train -> eval -> train schedule, three times over on 2 gloo ranks: real megatron-core DDP and
distributed optimizer around the public test kit's toy model with emulated MXFP8 params. The loop
is a hand-written one in Megatron-LM's order (``megatron/training/training.py`` at tag
``core_v0.16.1``; line numbers in the comments; the step and the evaluation are the kit's
:mod:`~mbridge_mxfp8_plugin.testing.megatron_lm_loop`), with :func:`~mbridge_mxfp8_plugin.mxfp8_param_sync`
called where the API's docstring tells a Megatron-LM user to add it. That way the demo shows what
a user's own loop gets, and it stands on nothing but the public API and the public test kit.

Modes: ``reference`` (bf16 params with the same MXFP8 rounding on the fly and no param gather,
i.e. what correct training computes), plugin OFF (MXFP8 params, fp8 param gather reusing the grad
buffer) and plugin ON (the same plus the API). All three run in one launch, one after the other,
so the ranks pay for process start-up and imports once.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

TOLERANCE = 1e-4
MODES = ("reference", "off", "on")
LABELS = {
    "reference": "reference (bf16 params, MXFP8 rounding on the fly, no param gather)",
    "off": "MXFP8 param gather + grad-buffer reuse, plugin OFF",
    "on": "MXFP8 param gather + grad-buffer reuse, plugin ON (mxfp8_param_sync)",
}


@dataclass
class DemoRun:
    """One mode's view from rank 0 (losses are averaged over the data-parallel ranks)."""

    train_losses: list[float] = field(default_factory=list)
    #: iteration count at the eval -> eval loss
    eval_losses: dict[int, float] = field(default_factory=dict)
    #: per step: bucket groups a forced sync left marked "gather dispatched" with no gather in
    #: flight when the step's forwards begin, i.e. whose gather and copy-back the step skips (C)
    skipped_gathers: list[int] = field(default_factory=list)
    offset_mismatches_before: int = 0
    offset_mismatches_after: int = 0
    offset_details: list[str] = field(default_factory=list)


def megatron_lm_loop(job: Any, *, plugin: bool, train_iters: int, eval_interval: int) -> DemoRun:
    """``train()`` of Megatron-LM core_v0.16.1 (L2417-3012) cut to train and eval, with the API."""
    import torch

    from .. import mxfp8_param_sync
    from ..testing.megatron_lm_loop import evaluate, train_step
    from ..testing.toy import make_batches

    model, optimizer = job.model, job.optimizer
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    run = DemoRun()
    eval_batches = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
    # should_disable_forward_pre_hook (L3496-3498): distributed optimizer with overlapped gather.
    toggle = job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather
    if toggle:  # L2657-2663: the first iteration runs without the pre-hooks
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=False)
    with mxfp8_param_sync(model, optimizer) if plugin else _Nothing() as sync:  # API: before L2684
        for iteration in range(train_iters):  # L2684
            sync.step_started()  # API: after L2785
            ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=iteration)
            run.train_losses.append(train_step(job, x, y, run.skipped_gathers))  # L2786-2797
            if iteration == 0 and toggle:  # L2815-2829: pre-hooks on after the first step
                for chunk in model:
                    chunk.enable_forward_pre_hook()
            if (iteration + 1) % eval_interval == 0:  # L2914
                if toggle:  # L2918-2920: the forced all-gather
                    for chunk in model:
                        chunk.disable_forward_pre_hook()
                sync.before_eval()  # API: before L2945
                run.eval_losses[iteration + 1] = evaluate(job, eval_batches)  # L2945-2949
                if toggle:  # L2959-2961
                    for chunk in model:
                        chunk.enable_forward_pre_hook()
                sync.after_eval()  # API: after L2961
        if toggle:  # L3006-3007: the closing forced sync
            for chunk in model:
                chunk.disable_forward_pre_hook()
    return run


class _Nothing:
    """Stands in for the API in the plugin-OFF and reference runs, so both run the same loop."""

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda: None


def _rank(train_iters: int, eval_interval: int) -> dict[str, DemoRun]:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from .. import check_bucket_alignment
    from ..testing import cpu_shim, emulated_mxfp8
    from ..testing.toy import ToyConfig, build_job

    runs: dict[str, DemoRun] = {}
    with cpu_shim(), emulated_mxfp8():
        for mode in MODES:  # the plugin run last: nothing it does can reach the other two
            job = build_job(replace(ToyConfig(), reference=(mode == "reference")))
            before: list[Any] = []
            if mode != "reference":
                before = check_bucket_alignment(job.model, repair=False).mismatches
            run = megatron_lm_loop(
                job, plugin=(mode == "on"), train_iters=train_iters, eval_interval=eval_interval
            )
            run.offset_mismatches_before = len(before)
            run.offset_details = [f"{m.param}: {m.found} -> {m.expected}" for m in before]
            if mode != "reference":
                run.offset_mismatches_after = len(check_bucket_alignment(job.model, repair=False).mismatches)
            runs[mode] = run
    return runs


def _fmt(value: float, ref: float) -> str:
    delta = value - ref
    mark = "ok" if abs(delta) <= TOLERANCE else "WRONG"
    return f"{value:9.5f} ({delta:+.1e} {mark})"


def _loss_table(
    out: TextIO,
    first: str,
    title: str,
    rows: list[tuple[int, int]],
    runs: tuple[Any, Any, Any],
    record: str,
) -> None:
    """One table of losses: reference, plugin off and on, each run's error next to it.

    ``rows`` pairs the label printed (an iteration) with the index into each run's ``record``.
    """
    ref, off, on = (getattr(run, record) for run in runs)
    header = f"{first:>5}  {title:>20}  {'plugin OFF':>26}  {'plugin ON':>26}"
    print("\n" + header + "\n" + "-" * len(header), file=out)
    for label, i in rows:
        r = ref[i]
        print(f"{label:>5}  {r:20.5f}  {_fmt(off[i], r):>26}  {_fmt(on[i], r):>26}", file=out)


def _worst(got: list[float], ref: list[float]) -> float:
    # NaN counts as the worst: core >= 0.18 without the plugin can evaluate gradients as weights.
    return max(
        (abs(a - b) if not math.isnan(a - b) else math.inf for a, b in zip(got, ref, strict=True)),
        default=0.0,
    )


def report(runs: dict[str, DemoRun], out: TextIO = sys.stdout) -> int:
    """Print the comparison; the exit code is 0 only if plugin ON matches the reference within
    :data:`TOLERANCE` at every eval and train loss and no bucket offset is left wrong."""
    ref, off, on = runs["reference"], runs["off"], runs["on"]
    evals = sorted(ref.eval_losses)
    after_eval = [it for it in evals if it < len(ref.train_losses)]  # 0-based index of the next step
    print(
        f"\ndefect A, bucket offsets: plugin OFF: {off.offset_mismatches_before} params mis-indexed by "
        f"megatron-core; plugin ON: repaired {on.offset_mismatches_before - on.offset_mismatches_after}, "
        f"{on.offset_mismatches_after} left",
        file=out,
    )
    for line in on.offset_details:
        print(f"    {line}", file=out)

    def eval_gap(run: DemoRun) -> float:
        return _worst([run.eval_losses[it] for it in evals], [ref.eval_losses[it] for it in evals])

    print(
        f"defects B1/B2, eval reads stale weights: worst eval-loss error OFF {eval_gap(off):.1e}, "
        f"ON {eval_gap(on):.1e}",
        file=out,
    )
    print(
        "defect C, the step after an eval skips its param gather: bucket-group gathers skipped "
        f"OFF {sum(off.skipped_gathers[i] for i in after_eval)}, "
        f"ON {sum(on.skipped_gathers[i] for i in after_eval)}",
        file=out,
    )
    trio = (ref, off, on)
    _loss_table(out, "eval@", "eval loss: reference", [(it, it) for it in evals], trio, "eval_losses")
    _loss_table(out, "step", "train loss after eval", [(i + 1, i) for i in after_eval], trio, "train_losses")
    ok = (
        sorted(on.eval_losses) == evals
        and eval_gap(on) <= TOLERANCE
        and _worst(on.train_losses, ref.train_losses) <= TOLERANCE
        and on.offset_mismatches_after == 0
    )
    print(
        "\nRESULT: plugin run matches the reference within 1e-4 (every eval and train loss)"
        if ok
        else "\nRESULT: plugin run does NOT match the reference",
        file=out,
    )
    return 0 if ok else 1


def collect_runs(*, world_size: int, train_iters: int, eval_interval: int) -> dict[str, DemoRun]:
    """The three modes on ``world_size`` spawned ranks; rank 0's records."""
    from ..testing import launch

    return launch(_rank, world_size, train_iters, eval_interval)[0]


def run_demo(
    *, world_size: int = 2, train_iters: int = 9, eval_interval: int = 3, out: TextIO = sys.stdout
) -> int:
    """Run the demo; returns the process exit code (0 only if the plugin run matches the reference)."""
    for i, mode in enumerate(MODES, 1):
        print(f"[{i}/3] {LABELS[mode]}", file=out)
    print(f"running the three on {world_size} ranks ... ", end="", file=out, flush=True)
    t0 = time.perf_counter()
    runs = collect_runs(world_size=world_size, train_iters=train_iters, eval_interval=eval_interval)
    print(f"done in {time.perf_counter() - t0:.1f}s", file=out, flush=True)
    return report(runs, out)
