"""``mxfp8-plugin doctor`` against docs/compatibility.md's row for the installed release pair. The defect
table it renders, decided from the probes: tests/unit/test_defects.py."""

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
        [sys.executable, "-m", "mbridge_mxfp8_plugin.commands.cli", "doctor", *args],
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
    from mbridge_mxfp8_plugin.probes.defects import DEFECTS

    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    for d in DEFECTS.values():
        assert d.symptom in proc.stdout and d.fixed_in in proc.stdout, d.id
    package = Path(__file__).resolve().parents[2] / "mbridge_mxfp8_plugin"
    doctor_src = (package / "commands" / "doctor.py").read_text()
    assert not any(d.symptom[:40] in doctor_src for d in DEFECTS.values())


def test_doctor_imports_neither_torch_nor_megatron() -> None:
    code = (
        "import sys; from mbridge_mxfp8_plugin.commands.doctor import diagnose; r = diagnose(); "
        "heavy = sorted(m for m in sys.modules "
        "if m.split('.')[0] == 'torch' or m.startswith('megatron.core')); "
        "print(heavy); assert not heavy, heavy; assert r['defects'], r"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_megatron_core_reports_the_core_defects_unknown(monkeypatch) -> None:
    """Unknown is not "none": without megatron-core, A, B1 and C are listed as unknown."""
    import io

    from mbridge_mxfp8_plugin.commands import doctor

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


class _FakeDist:
    """A distribution as ``importlib.metadata`` hands it out: a version and a file list."""

    def __init__(self, version: str, files: list[str] | None) -> None:
        self.version, self.files = version, files


def _fake_metadata(dists: dict[str, _FakeDist]) -> object:
    from types import SimpleNamespace

    def distribution(name: str) -> _FakeDist:
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]

    return SimpleNamespace(
        PackageNotFoundError=metadata.PackageNotFoundError,
        distribution=distribution,
        version=lambda name: distribution(name).version,
    )


_NEMO2 = {
    "nemo_toolkit": _FakeDist("2.7.3", ["nemo/__init__.py", "nemo/collections/llm/api.py"]),
    "lightning": _FakeDist("2.4.0", []),
}
_NEMO_SPEECH = {
    "nemo_toolkit": _FakeDist("3.0.0", ["nemo/__init__.py", "nemo/collections/asr/models.py"]),
    "lightning": _FakeDist("2.6.6", []),
}


def _doctor_text(monkeypatch, dists: dict[str, _FakeDist]) -> tuple[dict, str]:
    import io

    from mbridge_mxfp8_plugin.commands import doctor

    monkeypatch.setattr(doctor, "metadata", _fake_metadata(dists))
    report = doctor.diagnose()
    out = io.StringIO()
    doctor.render(report, out)
    return report, out.getvalue()


def test_doctor_lists_nemo_and_lightning_and_speaks_nemo(monkeypatch) -> None:
    """A NeMo 2 environment: nemo_toolkit and Lightning listed, the loop's stage / forced-sync /
    pre-hook points named in NeMo's terms, every defect with its NeMo wording, and why NeMo 2 users
    keep the defects (2.7 is the last NeMo with the LLM stack)."""
    from mbridge_mxfp8_plugin.commands import doctor
    from mbridge_mxfp8_plugin.probes.defects import NEMO_LAST_RELEASE, NEMO_TERMS

    monkeypatch.setattr(doctor, "probe_bridge_files", lambda: None)  # NeMo's env has no Bridge
    report, text = _doctor_text(monkeypatch, _NEMO2)
    assert re.search(r"^  nemo_toolkit +2\.7\.3$", text, re.M), text
    assert re.search(r"^  lightning +\S+$", text, re.M), text
    assert report["nemo"]["llm_stack"] is True
    assert "MegatronStrategy.save_checkpoint -> MegatronParallel.force_param_sync()" in text
    assert "toggles the forward pre-hooks around validation: never" in text
    assert "stages the fp32 main params before a forward: never" in text
    assert NEMO_LAST_RELEASE in text and "nemo_toolkit 3.0 is NeMo Speech" in text
    if report["defects"]:  # megatron-core installed: each defect also in NeMo's terms
        for d, info in report["defects"].items():
            assert info["nemo"] == NEMO_TERMS[d]
            assert f"in NeMo 2: {NEMO_TERMS[d]}" in text
        assert "on_megatron_microbatches_start" in report["defects"]["B2"]["plugin"]


def test_doctor_without_nemo_keeps_bridge_terms(monkeypatch) -> None:
    """No nemo_toolkit: listed as absent, and no NeMo wording (which would fail the NeMo test above
    if doctor printed it unconditionally)."""
    report, text = _doctor_text(monkeypatch, {})
    assert report["nemo"] is None
    assert re.search(r"^  nemo_toolkit +-$", text, re.M), text
    assert "NeMo 2 loop" not in text and "in NeMo 2:" not in text
    assert all("nemo" not in info for info in report["defects"].values())


def test_doctor_on_nemo_speech_says_there_is_no_llm_stack(monkeypatch) -> None:
    """nemo_toolkit 3.0 (NeMo Speech) has no NeMo 2 LLM loop: no NeMo-terms defect lines, and the
    line saying that 2.7 was the last release with it."""
    report, text = _doctor_text(monkeypatch, _NEMO_SPEECH)
    assert report["nemo"]["llm_stack"] is False
    assert "nemo_toolkit 3.0.0: NeMo Speech, no NeMo 2 LLM stack" in text
    assert "NeMo 2.7 is the last NeMo with the LLM stack" in text
    assert "in NeMo 2:" not in text and "NeMo 2 loop" not in text


def test_doctor_reads_the_resume_side(monkeypatch) -> None:
    """doctor's F verdict follows the probe (a loop that keeps the pre-hooks on: F fixed)."""
    from mbridge_mxfp8_plugin.commands import doctor
    from mbridge_mxfp8_plugin.probes.resume import ResumeBehaviour

    for keeps, expected in ((True, False), (False, True)):
        monkeypatch.setattr(doctor, "probe_resume_files", lambda k=keeps: ResumeBehaviour(k, False))
        report = doctor.diagnose()
        if report["defects"]:
            assert report["defects"]["F"]["present"] is expected
            assert "F" not in report["present"]  # a resume-only defect: not in the training list


@pytest.mark.parametrize("shipped", [True, False])
def test_doctor_names_the_param_syncs_it_leaves_alone(monkeypatch, shipped) -> None:
    """Megatron-FSDP and the LayerWise optimizer: doctor says whether the installed core ships
    them and why a job they own gets no engine (issue 24: check and doctor say why)."""
    import io

    from mbridge_mxfp8_plugin.commands import doctor
    from mbridge_mxfp8_plugin.probes.owners import OwnerFiles

    monkeypatch.setattr(doctor, "probe_owner_files", lambda: OwnerFiles(shipped, shipped, shipped))
    report = doctor.diagnose()
    out = io.StringIO()
    doctor.render(report, out)
    text = out.getvalue()
    word = "shipped by" if shipped else "not in"
    for name in ("Megatron-FSDP", "the LayerWise distributed optimizer"):
        assert report["owners"][name]["shipped"] is shipped
        assert re.search(rf"^  {name}: {word} this megatron-core; \S", text, re.M), text
