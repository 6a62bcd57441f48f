"""CUDA-graph capture of a plan's compares, and the process-wide state every capture shares.

The pool and the side stream are per device, not per plan: kept plans replay one at a time, so
one pool holds one batch's intermediates for all of them, and the allocator reuses a freed block
only on the stream that allocated it. A capture that fails may leave the allocator routing that
stream's allocations into the pool; that is undone, and no plan holding one of the failed plan's
write paths (its batch keys: the param type, its quantizer, how its blocks are read) is captured
again in the process, since what a type's write path does under capture does not change between
calls. A plan of other types still is: one type whose write syncs with the host does not cost
every other plan its replay.

A pool lives as long as a graph captured into it: once every such graph is gone (its plans were
dropped: a new layout, another job in the process), the allocator keeps the pool only to free it,
and a capture naming it again fails an internal assert. So the next capture takes a new pool.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch

__all__ = ["Uncapturable", "capture", "on_cuda", "refusal"]

_T = TypeVar("_T")

_POOLS: dict[int, Any] = {}
#: Graphs alive in each device's pool: at 0 the pool is spent, the next capture takes a new one.
_LIVE: dict[int, int] = {}
_STREAMS: dict[int, Any] = {}
#: Write paths (batch keys) whose capture failed in this process, and why.
_GRAPHS_OFF: dict[Any, str] = {}


class Uncapturable(Exception):
    """The compares could not be captured; the message is why (captures are then off)."""


def on_cuda(tensor: torch.Tensor) -> bool:
    """Whether a plan reading ``tensor`` runs where graphs are captured (one place the tests
    stand a CPU tensor in for a CUDA one)."""
    return bool(tensor.is_cuda)


def refusal(paths: Collection[Any] = ()) -> str:
    """Why a plan of these write paths may not be captured ('' where it may)."""
    if os.environ.get("MXFP8_VERIFY_CUDA_GRAPH", "1") == "0":
        return "MXFP8_VERIFY_CUDA_GRAPH=0"
    for path in paths:
        if path in _GRAPHS_OFF:
            return _GRAPHS_OFF[path]
    return ""


def capture(record: Callable[[], _T], paths: Collection[Any] = ()) -> tuple[Any, _T]:
    """The CUDA graph of what ``record`` launches, and what it returned (tensors of the graph).

    Not ``torch.cuda.graph``: its entry empties the allocator's cache (and collects garbage),
    which would cost the training job its cached blocks at every capture. Raises
    :class:`Uncapturable` after undoing what the failed capture left; ``paths`` (the plan's
    quantized write paths, where it has any) are then not captured again."""
    graph = torch.cuda.CUDAGraph()
    stream, caller = _capture_stream(), torch.cuda.current_stream()
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=_graph_pool(), capture_error_mode="thread_local")
            try:
                out = record()
            finally:
                graph.capture_end()
        caller.wait_stream(stream)
        _hold_pool(graph)
    except Exception as exc:  # noqa: BLE001 - eager compares judge the same
        caller.wait_stream(stream)
        _end_allocating_to_pool()
        reason = f"not capturable ({type(exc).__name__}: {exc})"
        for path in paths:
            _GRAPHS_OFF.setdefault(path, reason)
        raise Uncapturable(reason) from exc
    return graph, out


def _end_allocating_to_pool() -> None:
    """Undo what a failed capture may have left: the side stream allocating into the pool."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    device = torch.cuda.current_device()
    if end is not None and device in _POOLS:
        try:
            end(device, _POOLS[device])
        except Exception:  # noqa: BLE001, S110 - nothing was left to undo
            pass


def _hold_pool(graph: Any) -> None:
    """Count ``graph`` as keeping its device's pool alive until it is collected."""
    device = torch.cuda.current_device()
    _LIVE[device] = _LIVE.get(device, 0) + 1

    def released() -> None:
        _LIVE[device] -= 1

    weakref.finalize(graph, released)


def _capture_stream() -> Any:
    """One side stream per device for every capture: the allocator reuses a freed block only on
    the stream it was allocated on, so a new stream per capture would grow the pool each time."""
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


def _graph_pool() -> Any:
    """One memory pool per device for every plan's graph: they replay one at a time, so each
    graph's intermediates may reuse another's (outputs stay referenced and are not reused)."""
    device = torch.cuda.current_device()
    if device not in _POOLS or not _LIVE.get(device):
        _POOLS[device] = torch.cuda.graph_pool_handle()  # none yet, or the last one is spent
    return _POOLS[device]
