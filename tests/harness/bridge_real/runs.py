"""The runs the real-pretrain tests assert on: one rank launch, every mode one after the other.

Modes (``JobSpec.mode``): ``reference`` (bf16 params, MXFP8 rounding on the fly, no fp8 param
gather), ``mxfp8`` (emulated MXFP8 params, fp8 param gather with reuse, plugin off), ``aligned``
(plugin off, but the bucket offsets repaired at train start: B and C in isolation where A is
present), ``plugin`` (plugin on), ``resume`` (plugin on, a second ``pretrain()`` that loads the
plugin run's step-3 checkpoint and trains to the end), ``interleaved`` (plugin on, evals at 2, 4
and 6 around the save at 3). Every plugin run records what each of its hook calls cost
(``harness.bridge_real.costs``).

Every training run saves torch_dist checkpoints at its save interval (and at the end), so the
checkpoint tests read real files written by Bridge's ``save_checkpoint``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.bridge_real.config import JobSpec

SAVE_INTERVAL = 3


def base_spec(**overrides: Any) -> JobSpec:
    base = JobSpec(mode="reference", train_iters=6, eval_interval=3, save_interval=SAVE_INTERVAL)
    return replace(base, **overrides)


def specs_for(root: Path, *, with_aligned: bool, **overrides: Any) -> dict[str, JobSpec]:
    """The jobs of one launch, by name; ``root`` holds their checkpoints."""
    base = base_spec(record_events=True, **overrides)
    modes = ["reference", "mxfp8"] + (["aligned"] if with_aligned else []) + ["plugin"]
    specs = {m: replace(base, mode=m, save_dir=str(root / m)) for m in modes}
    specs["resume"] = replace(
        base,
        mode="plugin",
        save_dir=None,
        save_interval=None,
        load_dir=str(root / "plugin"),
        ckpt_step=SAVE_INTERVAL,
        # As a real MXFP8 job states it: Bridge >= 0.6 keys its MXFP8-resume path on it (F).
        model_fp8_recipe="mxfp8",
    )
    # Saves between evaluations (eval at 2, 4, 6; save at 3; the final save at 6; then the test):
    # the schedule in which the plugin once re-gathered on core 0.19 + Bridge 0.6 (issue 20).
    specs["interleaved"] = replace(
        base, mode="plugin", eval_interval=2, save_interval=SAVE_INTERVAL, save_dir=str(root / "interleaved")
    )
    return specs


#: The pipeline launch: name -> (mode, align_param_gather). ``None`` keeps Bridge's choice, True
#: for this layout; with it the interleaved schedule re-dispatches every chunk's all-gather at the
#: start of each step, which masks C. ``no_align`` is the same job with the flag off (megatron-core's
#: default, e.g. a Bridge config without a comm-overlap section), offsets repaired: B and C alone.
PIPELINE_RUNS = {
    "reference": ("reference", None),
    "mxfp8": ("mxfp8", None),
    "no_align": ("aligned", False),
    "plugin": ("plugin", None),
    "plugin_no_align": ("plugin", False),
}


def run_pipeline(world_size: int = 4) -> dict[str, list[Any]]:
    """PP=2 x DP=2 with virtual pipeline 2 (interleaved 1F1B, two model chunks per rank, p2p),
    the runs of ``PIPELINE_RUNS``, no checkpoints; name -> per-rank results."""
    from harness.bridge_real.worker import run_rank
    from mbridge_mxfp8_plugin.testing.launcher import launch

    # 4 steps: the eval at 3 is the forced sync, step 4 the step after it, then pretrain's final
    # validation and test evals at 4
    base = base_spec(pp=2, vp=2, num_microbatches=2, train_iters=4, save_interval=None, record_events=False)
    specs = [replace(base, mode=m, align_param_gather=a) for m, a in PIPELINE_RUNS.values()]
    timeout = float(os.environ.get("MXFP8_REAL_BRIDGE_TIMEOUT", "1500"))
    per_rank = launch(run_rank, world_size, tuple(specs), timeout=timeout)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(PIPELINE_RUNS)}


def run_all(root: Path, world_size: int = 2, *, with_aligned: bool, **overrides: Any) -> dict[str, list[Any]]:
    """mode -> per-rank results, from one launch of ``world_size`` ranks."""
    from harness.bridge_real.worker import run_rank
    from mbridge_mxfp8_plugin.testing.launcher import launch

    specs = specs_for(root, with_aligned=with_aligned, **overrides)
    timeout = float(os.environ.get("MXFP8_REAL_BRIDGE_TIMEOUT", "1500"))
    per_rank = launch(run_rank, world_size, tuple(specs.values()), timeout=timeout)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(specs)}
