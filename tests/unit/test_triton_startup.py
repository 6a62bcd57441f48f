"""Triton's once-per-process start-up in the background (``verify/triton_startup.py``): started by
an entry point built with ``verify_weights`` on, finished before any check launches a kernel, and
what it leaves behind is what a first launch would otherwise compute (the installation hash)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from mbridge_mxfp8_plugin import PluginOptions
from mbridge_mxfp8_plugin.adapters.session import Session
from mbridge_mxfp8_plugin.verify import triton_startup, weights

triton = pytest.importorskip("triton")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> triton_startup.StartupState:
    """A process that has not started it yet (the module's state is per process)."""
    monkeypatch.setattr(triton_startup, "_thread", None)
    state = triton_startup.StartupState()
    monkeypatch.setattr(triton_startup, "_state", state)
    monkeypatch.delenv("MXFP8_VERIFY_TRITON", raising=False)
    return state


def _key_cache() -> Any:
    key = triton_startup._triton_key()
    assert key is not None, "this Triton has no triton_key where the start-up looks for it"
    return key


@pytest.mark.parametrize("started", [True, False], ids=["started", "not started"])
def test_the_startup_leaves_tritons_installation_hash_computed(
    fresh: triton_startup.StartupState, started: bool
) -> None:
    """Started, the hash a process's first launch computes is already cached when the thread is
    done; not started, it is not (what the first check would then pay)."""
    key = _key_cache()
    key.cache_clear()
    if started:
        assert triton_startup.start()
    triton_startup.wait()
    assert (key.cache_info().currsize == 1) is started
    assert (fresh.seconds is not None) is started and fresh.error == ""


def test_it_starts_once_per_process_and_not_with_the_kernels_off(
    fresh: triton_startup.StartupState, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = []
    monkeypatch.setattr(triton_startup, "_run", lambda: runs.append(1))
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0")
    assert not triton_startup.start() and triton_startup._thread is None
    monkeypatch.delenv("MXFP8_VERIFY_TRITON")
    assert triton_startup.start() and triton_startup.start()
    triton_startup.wait()
    assert runs == [1]


def test_a_check_waits_for_a_running_startup(
    fresh: triton_startup.StartupState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify_weights`` blocks until the thread is done before it plans or launches anything."""
    release, seen = threading.Event(), []
    monkeypatch.setattr(triton_startup, "_run", lambda: (release.wait(5), seen.append("startup done")))
    monkeypatch.setattr(weights, "_check", lambda *a, **k: seen.append("check"))
    assert triton_startup.start()
    threading.Timer(0.05, release.set).start()
    weights.verify_weights([], None, event="test")
    assert seen == ["startup done", "check"]
    assert fresh.waited_s > 0


def test_a_failure_is_kept_and_said_not_raised(
    fresh: triton_startup.StartupState, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("no hash today")

    monkeypatch.setattr(triton_startup, "_triton_key", lambda: broken)
    assert triton_startup.start()
    triton_startup.wait()
    assert fresh.error == "RuntimeError: no hash today" and fresh.seconds is not None


@pytest.mark.parametrize("verify", [True, False], ids=["verify on", "verify off"])
def test_an_entry_point_with_the_check_on_starts_it_at_construction(
    fresh: triton_startup.StartupState, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    started = []
    monkeypatch.setattr(triton_startup, "start", lambda: started.append(time.perf_counter()) or True)
    Session("test", "TestCallback", PluginOptions(verify_weights=verify))
    assert bool(started) is verify
