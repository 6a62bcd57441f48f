"""``check`` reads a recipe as Megatron-Bridge does: one test per class of input that the
PyYAML reader got wrong (numbers, ``_target_`` sections, converted values, interpolations,
silently wrong files, hostile files), each on a file of ``tests/data``. The rules' messages on such
files: tests/unit/test_combination.py; a missing reader: tests/unit/test_missing.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness.check_io import DATA
from harness.check_io import run as _run
from harness.check_io import run_json as _json
from harness.check_io import status as _status
from harness.mx_cases import ROOT

from mbridge_mxfp8_plugin.config.read import MAX_BYTES, read_recipe_file
from mbridge_mxfp8_plugin.probes import bridge_facts as installed


# --------------------------------------------------------------------------- numbers
def test_scientific_notation_is_a_number_in_files_and_overrides():
    recipe = read_recipe_file(DATA / "numbers.yaml")
    assert recipe.data["optimizer"]["lr"] == pytest.approx(1e-4)
    assert recipe.data["optimizer"]["adam_eps"] == pytest.approx(1e-8)
    code, report = _json(DATA / "numbers.yaml", ["optimizer.lr=3e-4", "ddp.bucket_size=4e7"], dp_size=8)
    assert code == 0, report
    assert _status(report)["MX102"] == "pass"
    # Quoted, it is text to Bridge too: a type error whose fix keeps the number, not ``lr: 1.0``.
    code, report = _json(DATA / "numbers.yaml", ["optimizer.lr='1e-4'"])
    (finding,) = [f for r in report["rules"] for f in r["findings"] if r["id"] == "MX102"]
    assert code == 1 and finding["knob"] == "optimizer.lr" and "1.0" not in finding["fix"]


# --------------------------------------------------------------------------- _target_ sections
def test_target_sections_are_accepted_as_bridge_instantiates_them():
    code, report = _json(DATA / "target_sections.yaml", dp_size=8)
    assert code == 0, report
    assert _status(report)["MX101"] == "pass"
    assert _status(report)["MX001"] == "pass"  # judged as bf16_with_mxfp8_mixed: reuse on


@pytest.mark.parametrize(
    "name, rule",
    [("target_recipe_owns_reuse.yaml", "MX005"), ("target_mxfp8_overlap_off.yaml", "MX006")],
)
def test_target_recipe_function_is_judged_as_that_recipe(name, rule):
    code, report = _json(DATA / name)
    assert code == 1 and _status(report)[rule] == "fail", report


def test_target_recipe_function_with_arguments_is_an_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "mixed_precision:\n  _target_: megatron.bridge.training.mixed_precision.bf16_with_mxfp8_mixed\n"
        "  fp8_param_gather: false\n"
    )
    code, out, _ = _run(path)
    assert code == 1 and "error MX101 mixed_precision.fp8_param_gather" in out


# --------------------------------------------------------------------------- converted values
def test_dtype_names_are_judged_by_the_installed_bridge():
    facts = installed.bridge_facts()
    code, report = _json(DATA / "dtype_names.yaml")
    bridge_converts_bf16 = facts is not None and "bf16" in facts.dtype_names
    assert (code == 0) == bridge_converts_bf16, report
    if facts is None:
        assert any("not checked" in s or "not installed" in s for s in report["skipped"])


def test_recipe_names_come_from_the_installed_registry(tmp_path):
    facts = installed.bridge_facts()
    if facts is None:
        pytest.skip("no Megatron-Bridge installed")
    assert "bf16_with_mxfp8_mixed" in facts.recipe_names
    path = tmp_path / "r.yaml"
    # Registered by Bridge >= 0.6 only: accepted exactly when the installed Bridge has it.
    path.write_text("mixed_precision: nemotron_3_ultra_bf16_with_nvfp4_mixed\n")
    code, report = _json(path)
    assert (_status(report)["MX103"] == "pass") == (
        "nemotron_3_ultra_bf16_with_nvfp4_mixed" in facts.recipe_names
    )


# --------------------------------------------------------------------------- interpolations
def test_interpolation_into_the_base_is_not_checked_not_an_error():
    # the file states no plugin section (MX009 would warn): the override adds it
    code, out, err = _run(
        DATA / "interpolation_base.yaml", ["+mxfp8_plugin.enabled=true"], dp_size=8, fail_on_warning=True
    )
    assert code == 0, out + err
    assert "not checked: dataset.sequence_length = ${model.seq_length}" in out
    # resolved inside the file: ddp.overlap_param_gather -> optimizer's true
    assert read_recipe_file(DATA / "interpolation_base.yaml").data["ddp"]["overlap_param_gather"] is True


def test_missing_value_keeps_the_base_value_and_is_not_checked():
    """``???`` merged onto the base recipe keeps the base's value (Bridge's VL examples use it for
    "give this on the command line"): accepted, reported as not checked, never a traceback."""
    code, out, err = _run(DATA / "missing_value.yaml")
    assert code == 0 and "Traceback" not in out + err
    assert "not checked: checkpoint.save = ???: keeps the base recipe's value" in out
    assert "ddp.overlap_param_gather is ??? (the base recipe's value is kept)" in out  # MX013
    overrides = ["ddp.overlap_param_gather=true", "+mxfp8_plugin.enabled=true"]
    code, out, _ = _run(DATA / "missing_value.yaml", overrides, fail_on_warning=True)
    assert code == 0, out


def test_checked_knob_interpolating_into_the_base_says_so():
    code, report = _json(DATA / "interpolation_base_knob.yaml")
    (finding,) = [f for r in report["rules"] for f in r["findings"] if r["id"] == "MX013"]
    assert "${comm_overlap.overlap_param_gather}, an interpolation into the base recipe" in finding["message"]
    assert _status(report)["MX006"] == "n/a"  # unknown, not "off"


# --------------------------------------------------------------------------- unreadable input
UNREADABLE = {
    "bad_duplicate_section.yaml": "found duplicate key ddp",
    "bad_env_interpolation.yaml": "checkpoint.save: cannot resolve ${oc.env:MXFP8_PLUGIN_SURELY_UNSET",
    "bad_list_document.yaml": "the recipe is a list",
    "bad_scalar_document.yaml": "the recipe is a int",
    "bad_anchor_bomb.yaml": "anchors and aliases expand to more than",
    "bad_anchor_bomb_unknown_key.yaml": "anchors and aliases expand to more than",
    "bad_interpolation_fanout.yaml": "expands through more than",
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_unreadable_files_give_one_line_and_exit_2(name):
    code, out, err = _run(DATA / name)
    assert code == 2, out + err
    assert err == f"error: {DATA / name}: {err.split(': ', 2)[2]}" and err.count("\n") == 1
    assert UNREADABLE[name] in err and "Traceback" not in out + err


def test_non_utf8_directory_huge_and_multi_document(tmp_path):
    cases = {
        "latin1.yaml": (b"ddp:\n  x: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 13)"),
        "two.yaml": (b"ddp: {}\n---\noptimizer: {}\n", "holds several YAML documents"),
        "huge.yaml": (b"#" * (MAX_BYTES + 1), f"recipes of at most {MAX_BYTES} bytes are read"),
    }
    for name, (content, want) in cases.items():
        (tmp_path / name).write_bytes(content)
        code, _, err = _run(tmp_path / name)
        assert code == 2 and want in err and err.count("\n") == 1, (name, err)
    code, _, err = _run(tmp_path)
    assert code == 2 and err == f"error: {tmp_path}: is a directory; give a recipe YAML file\n"


_MEASURE = textwrap.dedent(
    """
    import io, json, resource, sys, time
    from mbridge_mxfp8_plugin.commands.check import run_check
    t0 = time.perf_counter()
    err = io.StringIO()
    code = run_check(sys.argv[1], out=io.StringIO(), err=err)
    # Peak RSS of this process image: VmHWM (Linux resets it at exec; ru_maxrss keeps the
    # forking parent's peak, here pytest's with torch loaded), else ru_maxrss.
    try:
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
        peak_mb = int(hwm.split()[1]) / 1024
    except (OSError, IndexError):
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    elapsed = time.perf_counter() - t0
    print(json.dumps({"code": code, "s": elapsed, "err": err.getvalue(), "peak_mb": peak_mb}))
    """
)


@pytest.mark.parametrize("name", ["bad_anchor_bomb.yaml", "bad_anchor_bomb_unknown_key.yaml"])
def test_anchor_bomb_is_refused_within_2s_and_200mb(name):
    """The PyYAML reader took 50 s and 3.3 GB on these. Measured in a fresh process (its own
    peak RSS, interpreter included) so nothing else the suite did counts."""
    env = {**os.environ, "NO_VCS_VERSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(DATA / name)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    result = json.loads(proc.stdout)
    assert result["code"] == 2 and result["err"].count("\n") == 1, result
    assert result["s"] < 2.0 and result["peak_mb"] < 200, result


def test_data_files_exist():
    assert len(list(Path(DATA).glob("*.yaml"))) >= 15


def test_without_bridge_the_report_says_what_was_not_checked(monkeypatch):
    monkeypatch.setattr(installed, "bridge_facts", lambda: None)
    import mbridge_mxfp8_plugin.config.sections as view

    monkeypatch.setattr(view, "bridge_facts", lambda: None)
    code, out, _ = _run(DATA / "dtype_names.yaml")
    assert code == 0, out  # bf16 not judged without a Bridge to say what it converts
    assert "not checked: mixed_precision recipe names and dtype names" in out
