"""Tiers by folder, and the shared fixtures.

Each folder under ``tests/`` is one tier (docs/testing.md): its tests get the tier's marker here, so
the Makefile, ``.ci/*.sh`` and a developer select a tier by folder or by ``-m``, never by a list of
files. ``matrix`` is set in the files themselves: it crosses tiers (what every release-pair cell runs).

Multi-rank runs are expensive (a process spawn + megatron import per rank), so each end-to-end
scenario runs once per session and tests assert on its recorded results."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("NO_VCS_VERSION", "1")
# The verifier's fused kernel (mbridge_mxfp8_plugin/verify/fused.py) runs on CPU tensors in Triton's
# interpreter, which Triton picks when it is first imported: set before anything imports it. Not on
# a CUDA host, where tests/gpu runs the compiled kernel. Spawned ranks inherit it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

TIERS = {
    "unit": "single process (spawns no ranks): `make test-fast`",
    "ranks": "spawns CPU gloo ranks of real megatron-core",
    "bridge_real": "Megatron-Bridge's own pretrain() from the installed wheel",
    "nemo": "NeMo 2's real Lightning stack (.venv-nemo, .ci/nemo.sh)",
    "gpu": "needs 2 CUDA GPUs with NCCL (skipped elsewhere)",
}
HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    known = {line.split(":")[0] for line in config.getini("markers")}
    for name, what in TIERS.items():
        if name not in known:  # pyproject.toml registers gpu
            config.addinivalue_line("markers", f"{name}: tier tests/{name}/, {what}")
    config.addinivalue_line("markers", "matrix: runs in every release-pair cell (.ci/matrix.sh: -m matrix)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test outside every tier folder is an error: it would run in no tier's selection."""
    for item in items:
        path = Path(str(item.path)).resolve()
        if not path.is_relative_to(HERE):
            continue
        parts = path.relative_to(HERE).parts
        tier = parts[0] if len(parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: put it in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def bridge_runs():
    """reference / mxfp8 (plugin off) / plugin runs of the default schedule, rank 0's view."""
    from harness.bridge_loop import LoopSchedule
    from harness.scenarios import run_bridge_scenario

    schedule = LoopSchedule(train_iters=10, eval_interval=3, eval_iters=2)
    return {
        mode: run_bridge_scenario(mode, schedule, run_test=True) for mode in ("reference", "mxfp8", "plugin")
    }


@pytest.fixture
def plugin_logger_restored():
    """The launcher's ``main`` gives the plugin's logger a stderr handler when nothing is configured
    (as a fresh launcher process has it); put the logger back for the rest of the session."""
    import logging

    log = logging.getLogger("mbridge_mxfp8_plugin")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]
