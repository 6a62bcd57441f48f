"""``mxfp8-plugin doctor`` in NeMo 2's real environment (``.venv-nemo``): the installed
nemo_toolkit and Lightning are listed, NeMo 2's loop is described in NeMo's terms, and the defects
megatron-core 0.15 has are all present (NeMo pins core < 0.16). The unit tier checks the same
wording against faked distributions; this checks that the real install is recognised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from mbridge_mxfp8_plugin.probes.defects import NEMO_LAST_RELEASE, NEMO_TERMS

try:
    NEMO = metadata.version("nemo_toolkit")
except metadata.PackageNotFoundError:  # the other tiers' venvs
    NEMO = None

pytestmark = pytest.mark.skipif(NEMO is None, reason="nemo_toolkit is not installed (run .ci/nemo.sh)")


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mbridge_mxfp8_plugin.commands.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_VCS_VERSION": "1"},
    )


def test_doctor_recognises_the_installed_nemo_2() -> None:
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"]["nemo_toolkit"] == NEMO
    assert report["versions"]["lightning"] == metadata.version("lightning")
    assert report["nemo"]["llm_stack"] is True
    assert report["bridge_loop"] is None  # the NeMo tier installs no Megatron-Bridge
    assert set(report["present"]) == {"A", "B1", "B2", "C"}, report["present"]  # core 0.15
    assert {d: info["nemo"] for d, info in report["defects"].items()} == NEMO_TERMS
    assert "on_megatron_microbatches_start" in report["defects"]["B2"]["plugin"]


def test_doctor_text_names_nemos_forced_sync_and_its_end() -> None:
    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    assert f"nemo_toolkit {NEMO}" in proc.stdout
    assert "MegatronStrategy.save_checkpoint -> MegatronParallel.force_param_sync()" in proc.stdout
    assert NEMO_LAST_RELEASE in proc.stdout
