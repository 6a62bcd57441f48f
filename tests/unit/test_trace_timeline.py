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


def test_the_python_functions_of_a_call_are_listed_nested_on_its_clock(tmp_path: Path) -> None:
    """A trace written with the Python tracer on (``VERIFY_TRACE_PYTHON=1``) holds
    ``python_function`` events; ``--python`` lists the plugin's within the call, indented by the
    shown ones enclosing them, none shorter than 1 us and none of other packages."""
    path = tmp_path / "t.json.gz"
    plugin = "x/mbridge_mxfp8_plugin/verify/"
    events = [
        _event("verify_weights call", "user_annotation", 1000.0, 300.0),
        _event(plugin + "weights.py(120): verify_weights", "python_function", 1002.0, 290.0),
        _event(plugin + "weights.py(267): _replay_early", "python_function", 1005.0, 40.0),
        _event(plugin + "shard.py(105): launch", "python_function", 1030.0, 12.0),
        _event(plugin + "report.py(9): tiny", "python_function", 1050.0, 0.5),
        _event("x/torch/cuda/graphs.py(137): replay", "python_function", 1031.0, 10.0),
        _event(plugin + "shard.py(376): finish", "python_function", 1100.0, 150.0),
        _event(plugin + "shard.py(376): finish", "python_function", 1500.0, 9.0),  # after the call
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    module = _module()
    lines = module.timeline(path, call=0, python="mbridge_mxfp8_plugin").splitlines()
    head = "Python functions of mbridge_mxfp8_plugin (1 us or more), in us from the call's start:"
    shown = lines[lines.index(head) + 1 : lines.index("GPU time per call (mean over the calls), by kernel:")]
    assert [line[18:] for line in shown] == [
        "verify/weights.py(120): verify_weights",
        "  verify/weights.py(267): _replay_early",
        "    verify/shard.py(105): launch",
        "  verify/shard.py(376): finish",
    ]
    assert shown[2].split()[:2] == ["30.0", "12.0"]
    assert "Python functions" not in module.timeline(path, call=0)  # only when asked
