"""``benchmarks/trace_timeline.py`` reads the GPU's idle gaps and each kernel's time per call from
a chrome trace as torch's profiler writes it (the events it relies on, written here by hand)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_timeline.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("trace_timeline", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name: str, cat: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def _trace(path: Path) -> None:
    events = []
    for start in (1000.0, 2000.0):  # two calls: a launch, then two kernels 20 us apart
        events += [
            _event("verify_weights call", "user_annotation", start, 300.0),
            _event("cudaGraphLaunch", "cuda_runtime", start + 50, 8.0),
            _event("compare", "kernel", start + 70, 100.0),
            _event("values", "kernel", start + 190, 4.0),
        ]
    events.append(_event("unrelated", "kernel", 500.0, 9.0))  # before any call: not counted
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_the_timeline_shows_the_gpus_idle_gaps_and_each_kernels_time_per_call(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    _trace(path)
    text = _module().timeline(path, call=1)
    lines = text.splitlines()
    assert lines[0].startswith("t.json.gz: 2 calls; call 1")
    values = next(line for line in lines if line.endswith("values") and "idle" in line)
    assert "idle   20.0" in values  # 1190 - (1070 + 100)
    compare = next(line for line in lines if line.endswith("compare") and "first GPU event" in line)
    assert compare.split()[0] == "70.0"
    per_call = lines[lines.index("GPU time per call (mean over the calls), by kernel:") + 1 :]
    assert [line.split()[-1] for line in per_call] == ["compare", "values"]
    assert per_call[0].split()[0] == "100.0" and "unrelated" not in text


def test_a_file_that_is_not_a_trace_is_named_with_how_to_write_one(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not json")
    module = _module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["trace_timeline.py", str(bad)])
        with pytest.raises(SystemExit) as exc:
            module.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "notes.txt: not a readable chrome trace" in err and "VERIFY_TRACE_DIR" in err
