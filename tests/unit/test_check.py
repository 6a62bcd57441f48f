"""``mxfp8-plugin check``: exit codes, one clear line per bad input, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness.check_io import run as _run
from harness.mx_cases import CASES, RECIPES, ROOT, TINY, Case

from mbridge_mxfp8_plugin.commands.cli import build_parser


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "mbridge_mxfp8_plugin.commands.cli", "check", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_check_is_wired_into_the_console_script():
    args = build_parser().parse_args(["check", "r.yaml", "ddp.x=1", "--dp-size", "8", "--json"])
    assert (args.recipe, args.overrides, args.dp_size, args.json) == ("r.yaml", ["ddp.x=1"], 8, True)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_pass(recipe):
    code, out, err = _run(recipe, dp_size=8, fail_on_warning=True)
    assert code == 0, out + err
    for rule in ("MX001", "MX009", "MX101"):
        assert rule in out
    assert "0 error(s), 0 warning(s)" in out and err == ""


def test_shipped_recipe_through_the_real_console_script():
    """Real installed stack, real process: exit 0, the table, no traceback."""
    proc = _cli(str(RECIPES[0].relative_to(ROOT)), "--dp-size", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MX008  pass" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_rule_fails_the_cli(case: Case):
    code, out, err = _run(
        TINY,
        case.overrides,
        dp_size=case.dp_size,
        installed=case.installed,
        fail_on_warning=case.severity == "warning",
    )
    assert code == 1, out
    line = f"{case.severity} {case.rule} "
    assert any(line in x and case.knob in x for x in out.splitlines()), out
    assert err.count("\n") == 1 and case.rule in err  # one summary line on stderr
    if case.severity == "warning":  # warnings alone do not fail a plain check
        assert _run(TINY, case.overrides, dp_size=case.dp_size, installed=case.installed)[0] == 0


def test_json_output(tmp_path):
    code, out, _ = _run(TINY, ["ddp.overlap_grad_reduce=false"], as_json=True)
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["recipe"] == str(TINY)
    assert {r["id"]: r["status"] for r in data["rules"]}["MX006"] == "fail"
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n")
    code, out, _ = _run(bad, as_json=True)
    assert code == 2 and "a list" in json.loads(out)["unreadable"]


# One bad input per row, alike in shape on purpose (duplicates lists neighbouring rows): a table.
MALFORMED = {
    "empty": ("", 2, "the recipe is empty"),
    "list": ("- ddp\n- optimizer\n", 2, "the recipe is a list"),
    "scalar": ("42\n", 2, "the recipe is a int"),
    "invalid-yaml": ("ddp: [\n", 2, "invalid YAML at line 2"),
    "tab-indent": ("ddp:\n\tx: 1\n", 2, "invalid YAML"),
    "non-boolean": (
        "ddp:\n  overlap_param_gather: 'true'\n",
        1,
        "ddp.overlap_param_gather must be a boolean",
    ),
    "int-as-boolean": ("ddp:\n  use_distributed_optimizer: 1\n", 1, "must be a boolean (true/false), got 1"),
    "section-not-mapping": ("ddp: true\n", 1, "ddp must be a mapping of knobs"),
    "unknown-section": ("dpp:\n  overlap_param_gather: true\n", 1, "dpp is not a section"),
    "unknown-key": ("ddp:\n  overlap_param_gathr: true\n", 1, "did you mean 'overlap_param_gather'"),
    "unknown-mixed-precision": (
        "mixed_precision: bf16_mxfp8\n",
        1,
        "not a Megatron-Bridge mixed-precision recipe",
    ),
    "plugin-not-mapping": ("mxfp8_plugin: true\n", 1, "mxfp8_plugin must be a mapping"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_input_gives_one_clear_line(tmp_path, name):
    text, want_code, want_msg = MALFORMED[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    code, out, err = _run(path)
    assert code == want_code, out + err
    assert "Traceback" not in out + err
    assert err.count("\n") == 1 and want_msg in err, err


def test_missing_file_and_bad_override():
    code, out, err = _run("does/not/exist.yaml")
    assert code == 2 and err == "error: does/not/exist.yaml: no such recipe file\n"
    code, out, err = _run(TINY, ["mixed_precision.fp8=e4m3"])
    assert code == 2 and "mixed_precision is 'bf16_with_mxfp8_mixed', not a section" in err
    assert _run(TINY, dp_size=0)[0] == 2


def test_malformed_input_through_the_real_console_script(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n")
    proc = _cli(str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: the recipe is a list; expected a mapping of "
        "ConfigContainer sections (ddp:, optimizer:, ...)"
    ]
    bad = tmp_path / "bool.yaml"
    bad.write_text("ddp:\n  overlap_param_gather: 'yes'\n")
    proc = _cli(str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "MX102 ddp.overlap_param_gather" in proc.stderr


def _imported(*args: str) -> set[str]:
    """Every module a real ``python -X importtime`` process imported."""
    env = {**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }


@pytest.mark.parametrize(
    "overrides", [[], ["optimizer.lr=3e-4", "~ddp.bucket_size"]], ids=["file", "overrides"]
)
def test_check_imports_neither_torch_nor_megatron_core(overrides):
    """The property behind check's speed: the installed releases are read from their files."""
    modules = _imported(
        "-m", "mbridge_mxfp8_plugin.commands.cli", "check", str(RECIPES[0].relative_to(ROOT)), *overrides
    )
    # it did run (importlib.import_module'd packages show only through their submodules)
    assert "mbridge_mxfp8_plugin.config.rules" in modules and "omegaconf.base" in modules
    heavy = sorted(
        m for m in modules if m.split(".")[0] in ("torch", "lightning") or m.startswith("megatron.")
    )
    assert heavy == [], heavy


def test_check_on_a_clean_file_leaves_what_it_does_not_use_unimported():
    """What the speed work took off check's path stays off: each of these was imported on every
    run (logging by the CLI, shutil by argparse's terminal-width lookup, difflib for a
    did-you-mean on a clean file, the live-layout reader and every probe module through the
    probes package) and cost a share of check's time over its floor (benchmarks/check_speed.py)."""
    modules = _imported("-m", "mbridge_mxfp8_plugin.commands.cli", "check", str(RECIPES[0].relative_to(ROOT)))
    assert "mbridge_mxfp8_plugin.config.rules" in modules  # it did run the rules
    unused = {"logging", "shutil", "difflib", "mbridge_mxfp8_plugin.mcore.layout"}
    assert sorted(unused & modules) == []


def test_plugin_options_doc_lists_every_option_although_built_lazily():
    from mbridge_mxfp8_plugin.options import PluginOptions, option_types

    doc = PluginOptions.__doc__ or ""
    assert all(f"{name} (default " in doc for name in option_types()), doc[-400:]


def test_importing_the_package_is_lazy():
    modules = _imported("-c", "import mbridge_mxfp8_plugin as m; m.PluginOptions; m.MXFP8ConfigError")
    assert not any(m.split(".")[0] == "torch" or m.startswith("megatron.") for m in modules)
    assert (
        "mbridge_mxfp8_plugin.adapters.bridge" not in modules
        and "mbridge_mxfp8_plugin.validate" not in modules
    )


# --------------------------------------------------------------------------- check says only what it checked
def test_deleting_a_key_no_bridge_section_has_is_refused_as_bridge_refuses_it():
    """``~train.nope``: Hydra (Bridge's parse, the launcher) refuses it; check used to exit 0."""
    from mbridge_mxfp8_plugin.probes.fields import config_py

    if config_py() is None:
        pytest.skip("Megatron-Bridge's files are not installed here (the fast tier's venv has them)")
    code, out, err = _run(TINY, ["~train.nope"])
    assert code == 2, out + err
    assert "~train.nope" in err and "'nope'" in err and "does not exist" in err
    # A key the section does have deletes from the base recipe: still "not checked", not refused.
    code, out, err = _run(TINY, ["~train.manual_gc"], dp_size=8)
    assert code == 0, out + err
    assert "~train.manual_gc: deletes a key of the base recipe" in out


def test_header_echoes_every_argument_given():
    code, out, _ = _run(TINY, dp_size=64)
    assert out.splitlines()[0].endswith("--dp-size 64"), out.splitlines()[0]
