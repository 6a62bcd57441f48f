"""The process-wide CUDA-graph capture state of the shard check (verify/graphs.py).

No GPU here: ``torch.cuda``'s graph, stream and pool calls are replaced by recorders, which is
all this module drives. What it promises (its docstring): a capture that fails raises
:class:`Uncapturable` with the reason, after the capture was ended and the caller's stream
waited, and turns captures off for the process (``refusal`` then gives that reason);
``MXFP8_VERIFY_CUDA_GRAPH=0`` turns them off from the start; every capture on a device uses one
side stream and one memory pool. No test of the suite captures a real graph (CI has no GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.verify import graphs


class _Calls:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []


class _Stream:
    def __init__(self, calls: _Calls, name: str) -> None:
        self.calls, self.name = calls, name

    def wait_stream(self, other: _Stream) -> None:
        self.calls.log.append(("wait", (self.name, other.name)))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    calls = _Calls()
    caller = _Stream(calls, "caller")
    made: list[int] = []

    class Graph:
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            calls.log.append(("begin", (pool, capture_error_mode)))

        def capture_end(self) -> None:
            calls.log.append(("end", None))

    def new_stream() -> _Stream:
        made.append(1)
        return _Stream(calls, f"side{len(made)}")

    @contextlib.contextmanager
    def on(stream: _Stream):
        calls.log.append(("on", stream.name))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: caller)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.log.append(("undo", d)), raising=False
    )
    monkeypatch.setattr(graphs, "_POOLS", {})
    monkeypatch.setattr(graphs, "_STREAMS", {})
    monkeypatch.setattr(graphs, "_GRAPHS_OFF", {})
    monkeypatch.delenv("MXFP8_VERIFY_CUDA_GRAPH", raising=False)
    return calls


def test_captures_are_allowed_until_turned_off(cuda: _Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    assert graphs.refusal() == ""
    monkeypatch.setenv("MXFP8_VERIFY_CUDA_GRAPH", "0")
    assert graphs.refusal() == "MXFP8_VERIFY_CUDA_GRAPH=0"


def test_a_capture_returns_the_graph_and_what_was_recorded(cuda: _Calls) -> None:
    graph, out = graphs.capture(lambda: "verdicts")
    assert out == "verdicts" and isinstance(graph, torch.cuda.CUDAGraph)
    names = [name for name, _ in cuda.log]
    assert names == ["wait", "on", "begin", "end", "wait"]
    assert cuda.log[0][1] == ("side1", "caller") and cuda.log[-1][1] == ("caller", "side1")
    assert cuda.log[2][1][1] == "thread_local"  # another thread's CUDA work does not break it
    assert graphs.refusal() == ""


def test_every_capture_on_a_device_shares_one_stream_and_one_pool(cuda: _Calls) -> None:
    graphs.capture(lambda: None)
    graphs.capture(lambda: None)
    pools = [args[0] for name, args in cuda.log if name == "begin"]
    streams = {args[0] for name, args in cuda.log if name == "wait" and args[0] != "caller"}
    assert len(pools) == 2 and pools[0] is pools[1] and pools[0] is not None
    assert streams == {"side1"}


def test_a_failed_capture_is_undone_and_turns_captures_off_for_its_write_paths(cuda: _Calls) -> None:
    """Off for every plan holding one of the failed plan's write paths; a plan of other types
    (unrelated to the write that synced with the host) is still captured (issue 32.1)."""

    def record() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    failed = {("mxfp8", "HostSyncingType")}
    with pytest.raises(graphs.Uncapturable, match="not capturable.*RuntimeError.*stream is capturing") as err:
        graphs.capture(record, failed)
    names = [name for name, _ in cuda.log]
    assert names[:4] == ["wait", "on", "begin", "end"]  # the capture was ended ...
    assert ("wait", ("caller", "side1")) in cuda.log  # ... the caller waits for the side stream ...
    assert ("undo", 0) in cuda.log  # ... and the pool no longer takes the stream's allocations
    assert graphs.refusal(failed | {("bf16", "Tensor")}) == str(err.value)  # a plan holding that path
    assert graphs.refusal({("mxfp8", "AnotherType")}) == ""  # an unrelated plan may capture
    graph, out = graphs.capture(lambda: "verdicts", {("mxfp8", "AnotherType")})
    assert out == "verdicts"
