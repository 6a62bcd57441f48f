"""Ready-made multi-rank runs: the same train -> eval -> train schedule, three ways.

* ``reference``: bf16 params with the same MXFP8 rounding on the fly, no param gather;
* ``mxfp8``: emulated MXFP8 params, fp8 param gather with grad-buffer reuse, no plugin;
* ``plugin``: the same with :class:`~mbridge_mxfp8_plugin.MXFP8ParamSyncCallback`;
* ``aligned``: plugin off, but the bucket offsets repaired (defect A) before training, so that
  B and C show in isolation on megatron-core <= 0.16.

Keyword options: ``loop`` replays a given Megatron-Bridge release's loop order ("0.3.1" default,
"0.4.2", "0.5.1", "0.6.2"), ``eval_only`` runs Bridge's ``skip_train`` path, ``instrument``
counts param all-gathers and digests every DDP buffer at each callback event.

Used by the tests and by ``mxfp8-plugin demo``; each call spawns fresh ranks.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mbridge_mxfp8_plugin.testing.launcher import launch
from mbridge_mxfp8_plugin.testing.toy import ToyConfig

from .weights import RunRecord

__all__ = ["ScenarioResult", "run_bridge_scenario", "MODES"]

MODES = ("reference", "mxfp8", "plugin", "aligned")


@dataclass
class ScenarioResult(RunRecord):
    mode: str = ""
    offset_mismatches_before: int = 0
    offset_mismatches_after: int = 0
    offset_details: list[str] = field(default_factory=list)
    plugin_events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: Bridge release whose loop order ran
    loop: str = "0.3.1"
    #: callbacks fired and forced syncs issued by the loop, in order
    loop_events: list[str] = field(default_factory=list)
    #: instrument=True: param all-gathers issued (every dist_all_gather_func call in buckets)
    all_gathers: int = 0
    #: instrument=True: (event, all-gathers so far, digest of every DDP buffer) after each callback
    trace: list[tuple[str, int, str]] = field(default_factory=list)
    hashed_weights: dict[int, dict[str, Any]] = field(default_factory=dict)


def _buffer_digest(model: list[Any]) -> str:
    """sha1 over the bytes of every grad and param buffer of every chunk (shared storage once)."""
    import torch

    h = hashlib.sha1()
    seen: set[int] = set()
    for chunk in model:
        for buffer in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for t in (buffer.grad_data, getattr(buffer, "param_data", None)):
                if t is None:
                    continue
                key = t.untyped_storage().data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                flat = t.detach().contiguous().view(-1)
                raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
                h.update(raw.numpy().tobytes())
    return h.hexdigest()[:16]


class _Recorder:
    """Registered after the plugin: sees the buffers as the plugin left them at every event."""

    def __init__(self, model: list[Any], counter: dict[str, int]) -> None:
        self.model, self.counter = model, counter
        self.trace: list[tuple[str, int, str]] = []

    def _rec(self, event: str) -> None:
        self.trace.append((event, self.counter["all_gathers"], _buffer_digest(self.model)))


def _make_recorder_events() -> None:
    for event in (
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_train_end",
        "on_eval_start",
        "on_eval_step_start",
        "on_eval_step_end",
        "on_eval_end",
        "on_test_start",
        "on_test_step_start",
        "on_test_step_end",
        "on_test_end",
        "on_checkpoint_save",
    ):

        def method(self: _Recorder, context: Any, _e: str = event) -> None:
            self._rec(_e)

        setattr(_Recorder, event, method)


_make_recorder_events()


def _count_all_gathers(counter: dict[str, int]) -> None:
    """Count every param all-gather megatron-core's buckets issue (module global, all releases)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    original = pgb.dist_all_gather_func

    def counting(*args: Any, **kwargs: Any) -> Any:
        counter["all_gathers"] += 1
        return original(*args, **kwargs)

    pgb.dist_all_gather_func = counting


def _rank_body(
    mode: str,
    toy: ToyConfig,
    schedule: Any,
    run_test: bool,
    keep_weights: bool,
    callback_kwargs: dict[str, Any],
    loop: str | None = None,
    eval_only: bool = False,
    instrument: bool = False,
) -> ScenarioResult:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback, check_bucket_alignment
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import build_job

    from .bridge_loop import evaluate_only, loop_order, train

    with cpu_shim(), emulated_mxfp8():
        job = build_job(replace(toy, reference=(mode == "reference")))
        before = after = 0
        details: list[str] = []
        if mode != "reference":
            probe = check_bucket_alignment(job.model, repair=False)
            before = len(probe.mismatches)
            details = [f"{m.param}: {m.found} -> {m.expected}" for m in probe.mismatches]
        if mode == "aligned":
            check_bucket_alignment(job.model, repair=True)
        callback = MXFP8ParamSyncCallback(**callback_kwargs) if mode == "plugin" else None
        callbacks: list[Any] = [callback] if callback else []
        counter = {"all_gathers": 0}
        recorder = None
        if instrument:
            _count_all_gathers(counter)
            recorder = _Recorder(job.model, counter)
            callbacks.append(recorder)
        order = loop_order(loop)
        run = evaluate_only if eval_only else train
        record = run(job, schedule, callbacks or None, run_test=run_test, loop=order)
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
            loop=order.release,
            loop_events=record.events,
            all_gathers=counter["all_gathers"],
            trace=recorder.trace if recorder else [],
            hashed_weights=record.hashed_weights if keep_weights else {},
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
    loop: str | None = None,
    eval_only: bool = False,
    instrument: bool = False,
) -> list[ScenarioResult]:
    """Run one mode on ``world_size`` ranks through the Bridge loop replica; per-rank results.

    ``loop`` selects the Bridge release's loop order (default 0.3.1), ``eval_only`` Bridge's
    ``skip_train`` path, ``instrument`` all-gather counting and buffer digests per event.
    """
    from .bridge_loop import LoopSchedule, loop_order

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    loop_order(loop)  # fail fast on an unknown release, before spawning ranks
    return launch(
        _rank_body,
        world_size,
        mode,
        toy or ToyConfig(),
        schedule or LoopSchedule(),
        run_test,
        keep_weights,
        callback_kwargs or {},
        loop,
        eval_only,
        instrument,
    )
