"""Ready-made multi-rank runs: the same train -> eval -> train schedule, three ways.

* ``reference``: bf16 params with the same MXFP8 rounding on the fly, no param gather;
* ``mxfp8``: emulated MXFP8 params, fp8 param gather with grad-buffer reuse, no plugin;
* ``plugin``: the same with :class:`~mbridge_mxfp8_plugin.MXFP8ParamSyncCallback`.

Used by the tests and by ``mxfp8-plugin demo``; each call spawns fresh ranks.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .launcher import launch
from .toy import ToyConfig

__all__ = ["ScenarioResult", "run_bridge_scenario", "MODES"]

MODES = ("reference", "mxfp8", "plugin")


@dataclass
class ScenarioResult:
    mode: str
    train_losses: list[float]
    eval_losses: dict[int, float]
    offset_mismatches_before: int = 0
    offset_mismatches_after: int = 0
    offset_details: list[str] = field(default_factory=list)
    saved_weights: dict[int, dict[str, Any]] = field(default_factory=dict)
    final_weights: dict[str, Any] = field(default_factory=dict)
    plugin_events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _rank_body(
    mode: str, toy: ToyConfig, schedule: Any, run_test: bool, keep_weights: bool, callback_kwargs: dict[str, Any]
) -> ScenarioResult:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback, check_bucket_alignment

    from .bridge_loop import train
    from .cpu_shim import cpu_shim
    from .emulated_mxfp8 import emulated_mxfp8
    from .toy import build_job

    with cpu_shim(), emulated_mxfp8():
        job = build_job(replace(toy, reference=(mode == "reference")))
        before = after = 0
        details: list[str] = []
        if mode != "reference":
            probe = check_bucket_alignment(job.model, repair=False)
            before = len(probe.mismatches)
            details = [f"{m.param}: {m.found} -> {m.expected}" for m in probe.mismatches]
        callback = MXFP8ParamSyncCallback(**callback_kwargs) if mode == "plugin" else None
        record = train(job, schedule, [callback] if callback else None, run_test=run_test)
        if mode != "reference":
            after = len(check_bucket_alignment(job.model, repair=False).mismatches)
        events = [(e, asdict(s)) for e, s in callback.history] if callback else []
        return ScenarioResult(
            mode=mode,
            train_losses=record.train_losses,
            eval_losses=record.eval_losses,
            offset_mismatches_before=before,
            offset_mismatches_after=after,
            offset_details=details,
            saved_weights=record.saved_weights if keep_weights else {},
            final_weights=record.final_weights if keep_weights else {},
            plugin_events=events,
        )


def run_bridge_scenario(
    mode: str,
    schedule: Any = None,
    toy: ToyConfig | None = None,
    *,
    world_size: int = 2,
    run_test: bool = False,
    keep_weights: bool = False,
    callback_kwargs: dict[str, Any] | None = None,
) -> list[ScenarioResult]:
    """Run one mode on ``world_size`` ranks through the Bridge 0.3.1 loop replica; per-rank results."""
    from .bridge_loop import LoopSchedule

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return launch(
        _rank_body,
        world_size,
        mode,
        toy or ToyConfig(),
        schedule or LoopSchedule(), run_test, keep_weights,
        callback_kwargs or {},
    )
