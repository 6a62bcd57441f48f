"""Shared fixtures. Multi-rank runs are expensive (a process spawn + megatron import per rank),
so each end-to-end scenario runs once per session and tests assert on its recorded results."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NO_VCS_VERSION", "1")


@pytest.fixture(scope="session")
def bridge_runs():
    """reference / mxfp8 (plugin off) / plugin runs of the default schedule, rank 0's view."""
    from harness.bridge_loop import LoopSchedule
    from harness.scenarios import run_bridge_scenario

    schedule = LoopSchedule(train_iters=10, eval_interval=3, eval_iters=2)
    return {
        mode: run_bridge_scenario(mode, schedule, run_test=True) for mode in ("reference", "mxfp8", "plugin")
    }
