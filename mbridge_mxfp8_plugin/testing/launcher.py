"""Run a function on N ranks with real torch.distributed collectives (gloo on CPU, NCCL on GPU).

Each rank is a fresh spawned process, so megatron-core's global state never leaks between
tests. The function's return value from every rank comes back to the caller; an exception on
any rank is re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["launch", "RankFailed"]


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NO_VCS_VERSION="1",
    )
    try:
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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results), daemon=False)
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
