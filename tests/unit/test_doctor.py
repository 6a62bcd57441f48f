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

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


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


def test_doctor_renders_the_one_defect_table() -> None:
    """Every row of defects.DEFECTS reaches the user verbatim; doctor keeps no prose of its own."""
    from mbridge_mxfp8_plugin.defects import DEFECTS

    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    for d in DEFECTS.values():
        assert d.symptom in proc.stdout and d.fixed_in in proc.stdout, d.id
    doctor_src = (Path(__file__).resolve().parents[2] / "mbridge_mxfp8_plugin" / "doctor.py").read_text()
    assert not any(d.symptom[:40] in doctor_src for d in DEFECTS.values())


def test_doctor_imports_neither_torch_nor_megatron() -> None:
    code = (
        "import sys; from mbridge_mxfp8_plugin.doctor import diagnose; r = diagnose(); "
        "heavy = sorted(m for m in sys.modules "
        "if m.split('.')[0] == 'torch' or m.startswith('megatron.core')); "
        "print(heavy); assert not heavy, heavy; assert r['defects'], r"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _core_files(*, a: bool, b1: bool, c: bool) -> object:
    from mbridge_mxfp8_plugin.probes import CoreBehaviour

    return CoreBehaviour(pads_bucket_offsets=a, forced_sync_writes_back=b1, has_dispatch_reset=c,
                         has_prepare_for_param_sync=c, has_reuse_knob=True)


@pytest.mark.parametrize(
    ("fixed", "loop", "present"),
    [
        # UPSTREAM.md: core 0.16.1 + Bridge 0.3/0.4 (no staging): everything.
        ((False, False, False), (False, False), {"A", "B1", "B2", "C", "E"}),
        # core 0.18.2 + Bridge 0.5.1: stages before evals only -> saves still gather gradients (B2).
        ((True, True, False), (True, False), {"B2", "C", "E"}),
        # core 0.19.2 + Bridge 0.6.2: fixed upstream; only the eval-only case remains.
        ((True, True, True), (True, True), {"E"}),
        # no Bridge installed: any hand-written loop is assumed not to stage.
        ((True, True, True), None, {"B2", "E"}),
    ],
)
def test_defects_present_is_decided_in_one_place(fixed, loop, present) -> None:
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin.defects import DEFECTS, defects_present

    staging = (
        None
        if loop is None
        else SimpleNamespace(stages_before_eval=loop[0], stages_before_every_forced_sync=loop[1])
    )
    got = defects_present(_core_files(a=fixed[0], b1=fixed[1], c=fixed[2]), staging)
    assert list(got) == list(DEFECTS)
    assert {d for d, p in got.items() if p} == present


def test_no_megatron_core_reports_the_core_defects_unknown(monkeypatch) -> None:
    """Unknown is not "none": without megatron-core, A, B1 and C are listed as unknown."""
    import io

    from mbridge_mxfp8_plugin import doctor

    monkeypatch.setattr(doctor, "probe_core_files", lambda: None)
    report = doctor.diagnose()
    assert report["core"] is None and "unknown" in report["error"]
    assert {d: report["defects"][d]["present"] for d in ("A", "B1", "C")} == dict.fromkeys(("A", "B1", "C"))
    assert report["unknown"] == ["A", "B1", "C"]
    out = io.StringIO()
    doctor.render(report, out)
    text = out.getvalue()
    assert text.count(" unknown  ") == 3, text
    assert "unknown (no megatron-core to read): A, B1, C" in text
    assert "present: none" not in text
