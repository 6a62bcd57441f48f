"""The console script in a real process, as the unit tests of the command line run it: ``python -m
mbridge_mxfp8_plugin.commands.cli ARGS`` from the checkout (:func:`cli`), and the promise every
failure keeps, one line on stderr with the exit code and never a traceback (:func:`one_line_failure`).
"""

from __future__ import annotations

import os
import subprocess
import sys

from .mx_cases import ROOT

__all__ = ["COULD_NOT_RUN", "TINY", "cli", "one_line_failure"]

#: the shipped tiny recipe, as a user types it in the checkout
TINY = "recipes/tiny_debug_mxfp8.yaml"
COULD_NOT_RUN = 2


def cli(*args: str, isolated: bool = False, **kw: object) -> subprocess.CompletedProcess[str]:
    """``python -m mbridge_mxfp8_plugin.commands.cli ARGS`` from the checkout. ``isolated``: without
    site-packages (``-S``), i.e. on a machine where torch, megatron-core, omegaconf are not installed."""
    env = {**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MXFP8_PLUGIN_TRACEBACK", None)
    if isolated:
        env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, *(["-S"] if isolated else []), "-m", "mbridge_mxfp8_plugin.commands.cli", *args]
    kw.setdefault("capture_output", True)
    return subprocess.run(cmd, text=True, cwd=ROOT, env=env, timeout=300, **kw)  # type: ignore[call-overload]


def one_line_failure(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    out = (proc.stdout or "") + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == code, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
