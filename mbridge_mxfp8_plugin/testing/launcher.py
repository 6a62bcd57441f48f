"""Run a function on N ranks with real torch.distributed collectives (gloo on CPU, NCCL on GPU).

Each rank is a fresh process, so megatron-core's global state never leaks between tests. The
function's return value from every rank comes back to the caller; an exception on any rank is
re-raised in the caller with that rank's traceback.

On a CPU host the ranks are forked from a server that has imported torch and megatron-core once
(multiprocessing's ``forkserver`` with a preload): a spawned rank spends 3-7 s importing them,
which a suite of a hundred launches pays for minutes. The server only imports; it never builds a
process group or a model, so each rank still starts from megatron-core's import-time state. The
rank adopts the caller's environment, working directory and ``sys.path`` *before* it unpickles
the function, so an environment variable set by a test reaches the function's module as under
``spawn``. On a CUDA host ranks are spawned (a fork after CUDA is touched is unsafe), and
``MXFP8_LAUNCH_START=spawn`` forces spawning anywhere.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["launch", "RankFailed"]

#: What the fork server imports once; a module missing here is skipped by multiprocessing.
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
)


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_method() -> str:
    forced = os.environ.get("MXFP8_LAUNCH_START", "")
    if forced:
        if forced not in ("spawn", "forkserver"):
            raise ValueError(f"MXFP8_LAUNCH_START={forced!r}: use 'spawn' or 'forkserver'")
        return forced
    return "spawn" if torch.cuda.is_available() else "forkserver"


def _context() -> Any:
    method = _start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _adopt(caller: dict[str, Any]) -> None:
    """Make a forked rank see what a spawned one would: the caller's environment, cwd and path."""
    os.environ.clear()
    os.environ.update(caller["environ"])
    os.chdir(caller["cwd"])
    sys.path[:] = caller["path"]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    caller: dict[str, Any],
    call: bytes,
    results: Any,
) -> None:
    _adopt(caller)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NO_VCS_VERSION="1",
    )
    try:
        fn, args = pickle.loads(call)  # after _adopt: fn's module imports under the caller's env
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size
        )
        try:
            # Pickled by value here: torch's queue would share tensors through file descriptors
            # that die with this process, which may exit before the parent reads them.
            results.put((rank, True, _to_bytes(fn(*args))))
        finally:
            torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def _to_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def launch(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks; returns the per-rank results in rank order.

    ``fn`` must be importable (module-level) because ranks are spawned, not forked.
    """
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    caller = {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
    call = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, caller, call, results), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    failures: list[str] = []
    import queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size and not failures:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
                if dead:
                    failures.append(
                        f"rank(s) {dead} died without reporting (exit codes "
                        f"{[procs[i].exitcode for i in dead]})"
                    )
                elif time.monotonic() > deadline:
                    failures.append(f"timed out after {timeout:.0f}s waiting for ranks")
                continue
            if ok:
                collected[rank] = pickle.loads(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 60)
            if p.is_alive():
                p.kill()
    if failures:
        raise RankFailed("\n".join(failures))
    return [collected[r] for r in range(world_size)]
