"""The same schedule through ``harness.bridge_loop`` (the replica), for the replica-vs-real test.

The replica drives a toy megatron-core model, not a GPT, but what is compared is model-independent:
the callback events (logged by the same recorder the real run uses) and the megatron-core calls
``harness.bridge_loop.recording_param_syncs`` logs (pre-hook toggles, forced syncs, staging).
"""

from __future__ import annotations

import warnings
from typing import Any


def _replica_rank(modes: tuple[str, ...], release: str) -> dict[str, list[str]]:
    return {mode: _replica_run(mode, release) for mode in modes}


def _replica_run(mode: str, release: str) -> list[str]:
    warnings.filterwarnings("ignore")
    from harness.bridge_loop import LoopSchedule, recording_param_syncs, train
    from harness.bridge_real.runs import base_spec
    from harness.bridge_real.worker import RankResult, _Recorder
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    spec = base_spec()
    schedule = LoopSchedule(
        train_iters=spec.train_iters,
        eval_interval=spec.eval_interval,
        eval_iters=spec.eval_iters,
        save_interval=spec.save_interval,
    )
    result = RankResult()
    events: list[str] = []
    with cpu_shim(), emulated_mxfp8(), recording_param_syncs(events):
        result.events = events
        job = build_job(ToyConfig())
        callbacks: list[Any] = [MXFP8ParamSyncCallback()] if mode == "plugin" else []
        callbacks.append(_Recorder(result, record_events=True))
        train(job, schedule, callbacks, run_test=spec.run_test, run_valid=True, loop=release)
    return list(events)


_CACHE: dict[str, dict[str, list[str]]] = {}


def replica_events(mode: str, release: str) -> list[str]:
    """Rank 0's event list of the replica run of ``mode`` with Bridge ``release``'s loop order
    (both modes come from one launch: the spawn and imports are most of the cost)."""
    from mbridge_mxfp8_plugin.testing.launcher import launch

    if release not in _CACHE:
        _CACHE[release] = launch(_replica_rank, 2, ("mxfp8", "plugin"), release)[0]
    return _CACHE[release][mode]
