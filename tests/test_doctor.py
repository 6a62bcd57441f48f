"""``mxfp8-plugin doctor`` against docs/compatibility.md's row for the installed release pair."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_VCS_VERSION": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mbridge_mxfp8_plugin.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _doc_rows() -> dict[tuple[str, str], set[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(\d+\.\d+\.\d+)\s*\|\s*(\d+\.\d+\.\d+)\s*\|\s*[\d.]+\s*\|\s*([^|]*)\|", line)
        if m:
            listed = m.group(3).strip()
            rows[(m.group(1), m.group(2))] = (
                set() if listed == "none" else {d.strip() for d in listed.split(",")}
            )
    return rows


def test_doc_lists_the_six_pairs() -> None:
    assert len(_doc_rows()) == 6


def test_doctor_json_matches_compatibility_doc() -> None:
    core = metadata.version("megatron-core").split("+")[0]
    try:
        bridge = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        pytest.skip("no megatron-bridge installed")
    rows = _doc_rows()
    if (core, bridge) not in rows:
        pytest.skip(f"megatron-core {core} + Megatron-Bridge {bridge} is not a documented release pair")
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"]["megatron-core"].split("+")[0] == core
    assert set(report["present"]) == rows[(core, bridge)], (report["present"], rows[(core, bridge)])
    assert report["defects"]["E"]["present"] is True


def test_doctor_text_exits_zero() -> None:
    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    assert "megatron-core" in proc.stdout and "plugin" in proc.stdout
