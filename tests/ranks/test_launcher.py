"""``testing.launcher``: ranks forked from a preloaded server see what spawned ranks would see.

The fork server starts once per process, with the environment of that moment; a test that sets
an environment variable, changes directory or extends ``sys.path`` afterwards must still reach
the rank's function and the module it lives in (which the rank imports after adopting them)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from mbridge_mxfp8_plugin.testing import launcher


def _what_the_rank_sees(name: str) -> dict[str, Any]:
    import torch

    return {
        "value": os.environ.get(name),
        "cwd": os.getcwd(),
        "path_tail": sys.path[-1],
        "rank": torch.distributed.get_rank(),
        "preloaded": "megatron.core.distributed" in sys.modules,
    }


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_sees_the_callers_environment_set_after_the_server_started(monkeypatch, tmp_path, method):
    monkeypatch.setenv("MXFP8_LAUNCH_START", method)
    launcher.launch(_what_the_rank_sees, 1, "HOME")  # the server (if any) exists from here on
    monkeypatch.setenv("MXFP8_LAUNCHER_PROBE", f"set-after-start-{method}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "last")])
    seen = launcher.launch(_what_the_rank_sees, 2, "MXFP8_LAUNCHER_PROBE")
    assert [s["rank"] for s in seen] == [0, 1]
    for s in seen:
        assert s["value"] == f"set-after-start-{method}"
        assert s["cwd"] == str(tmp_path) and s["path_tail"] == str(tmp_path / "last")
    if method == "forkserver":  # the point of the server: megatron-core is already imported
        assert all(s["preloaded"] for s in seen)


def test_a_wrong_start_method_names_the_variable(monkeypatch):
    monkeypatch.setenv("MXFP8_LAUNCH_START", "fork")
    with pytest.raises(ValueError, match="MXFP8_LAUNCH_START='fork'.*spawn.*forkserver"):
        launcher.launch(_what_the_rank_sees, 1, "HOME")


def test_a_rank_failure_comes_back_with_its_traceback():
    with pytest.raises(launcher.RankFailed, match="rank 1 failed"):
        launcher.launch(_fails_on_rank_one, 2)


def _fails_on_rank_one() -> None:
    import torch

    if torch.distributed.get_rank() == 1:
        raise RuntimeError("rank one refuses")
