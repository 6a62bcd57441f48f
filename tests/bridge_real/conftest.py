"""The bridge_real tier's shared fixtures."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from collections.abc import Callable

import pytest

_BRIDGE_MISSING = [
    n
    for n in ("transformers", "modelopt", "omegaconf", "megatron.bridge")
    if importlib.util.find_spec(n) is None
]


@pytest.fixture(scope="session")
def dry_run() -> Callable[..., tuple[int, str, str]]:
    """``main(["--dry-run", ...])`` of the launcher in this process on Bridge's real recipe flow
    (its ``omegaconf_utils``, ``pretrain`` module and ``ConfigContainer``), TE and CUDA stood in
    for by ``bridge_on_cpu``; returns ``(exit status, stdout, stderr)``."""
    from harness.bridge_cpu import bridge_on_cpu

    from mbridge_mxfp8_plugin.commands.launch import main

    def run(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with bridge_on_cpu(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--dry-run", *argv])
        return rc, out.getvalue(), err.getvalue()

    if _BRIDGE_MISSING and os.environ.get("MXFP8_REAL_BRIDGE") != "require":
        pytest.skip(f"needs {_BRIDGE_MISSING}")
    return run
