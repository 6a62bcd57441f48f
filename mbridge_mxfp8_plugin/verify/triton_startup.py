"""Triton's once-per-process start-up, paid in the background while a job builds its model.

Before a process's first kernel launch, Triton imports its front end and hashes its own
installation (``triton_key``, a SHA-256 of ``libtriton`` and its compiler sources), whatever its
on-disk cache holds. On an H100's host that was 0.6 of the 0.73-0.80 s a later job's first
weight check took at 1B (issue 32, ``benchmarks/results/verify_te_vector``: 0.44 s the hash,
0.13 s an import), paid at the train-start warm-up, where every rank waits. None of it needs the
GPU or the model, so a thread does it from the moment an entry point is built with
``verify_weights`` on, while the job sets up; the first check waits only for what is left.

The thread makes no CUDA call: a call from another thread while the job records a CUDA graph
would invalidate that capture. It compiles nothing either (which kernels, at which
specialisations, is only known once the plan is made). Hashing a large file releases the GIL,
so most of it overlaps the job's own Python.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["StartupState", "start", "state", "wait"]

_log = logging.getLogger(__name__)

#: The kernels' modules (their ``@triton.jit`` definitions) and the Triton modules a first
#: launch imports lazily (the Gluon front end, in the Triton releases that have one).
_MODULES = (
    "triton",
    "triton.experimental.gluon",
    "mbridge_mxfp8_plugin.verify._te_rule_kernel",
    "mbridge_mxfp8_plugin.verify._values_kernel",
    "mbridge_mxfp8_plugin.verify._gather_kernel",
)


@dataclass
class StartupState:
    """What the process's start-up did: ``seconds`` it took in its thread (None until done),
    ``waited_s`` a check spent waiting for it, and ``error`` (it is only ever an optimization:
    a failure leaves the first check to pay the cost, as without it)."""

    started: bool = False
    seconds: float | None = None
    waited_s: float = 0.0
    error: str = ""


_state = StartupState()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def state() -> StartupState:
    return _state


def start() -> bool:
    """Start the start-up thread, once per process. False where there is nothing to do: Triton
    is not installed, or the verifier's kernels are off (``MXFP8_VERIFY_TRITON=0``)."""
    global _thread
    with _lock:
        if _thread is not None:
            return True
        if os.environ.get("MXFP8_VERIFY_TRITON", "1") == "0" or importlib.util.find_spec("triton") is None:
            return False
        _state.started = True
        # Not a daemon: the interpreter joins it before it shuts down, so a short process never
        # finalizes while the thread holds a file it is hashing.
        _thread = threading.Thread(target=_run, name="mxfp8-verify-triton-startup", daemon=False)
        _thread.start()
        return True


def wait() -> None:
    """Block until a started start-up is done (so no check launches a kernel while it runs);
    returns at once where none runs."""
    thread = _thread
    if thread is None or not thread.is_alive():
        return
    t0 = time.perf_counter()
    thread.join()
    _state.waited_s += time.perf_counter() - t0


def _run() -> None:
    t0 = time.perf_counter()
    try:
        for name in _MODULES:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
        key = _triton_key()
        if key is not None:
            key()
    except Exception as exc:  # noqa: BLE001 - an optimization: the first launch pays instead
        _state.error = f"{type(exc).__name__}: {exc}"
        _log.debug("Triton start-up in the background failed: %s", _state.error)
    finally:
        _state.seconds = time.perf_counter() - t0


def _triton_key() -> Callable[[], object] | None:
    """Triton's cached installation hash, where this release has it (``runtime.cache`` from 3.2,
    ``compiler.compiler`` before)."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            key = getattr(importlib.import_module(module), "triton_key", None)
        except ImportError:
            continue
        if callable(key):
            return key  # type: ignore[no-any-return]
    return None
