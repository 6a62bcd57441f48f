"""MX009-MX011 (config/rules/release.py): the plugin on where the installed release pair needs it,
and how to switch it on where a recipe has no ``mxfp8_plugin`` section."""

from __future__ import annotations

import json

from harness.check_io import run as _run
from harness.check_io import without_plugin_section as _without_plugin_section
from harness.mx_cases import FIXED, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config


def test_no_plugin_section_on_a_defective_stack_warns_how_to_switch_it_on(tmp_path):
    path = _without_plugin_section(tmp_path)
    code, out, _ = _run(path, dp_size=2)
    assert code == 0, out  # a warning: the launcher or the script may still add the plugin
    (line,) = [ln for ln in out.splitlines() if ln.startswith("warning MX009")]
    assert "python -m mbridge_mxfp8_plugin.launch" in line and "callbacks=[MXFP8ParamSyncCallback()]" in line
    assert "mxfp8_plugin: {enabled: true}" in line
    assert _run(path, dp_size=2, fail_on_warning=True)[0] == 1
    code, out, _ = _run(path, dp_size=2, as_json=True)
    (mx009,) = [r for r in json.loads(out)["rules"] if r["id"] == "MX009"]
    assert mx009["status"] == "warn" and mx009["findings"][0]["severity"] == "warning"


def test_no_plugin_section_on_a_fixed_stack_is_fine(tmp_path):
    from harness.mx_cases import FIXED

    code, out, _ = _run(_without_plugin_section(tmp_path), dp_size=2, installed=FIXED, fail_on_warning=True)
    assert code == 0, out


def test_plugin_off_is_fine_where_core_has_no_defects():
    report = validate_config(read_recipe(TINY, ["mxfp8_plugin.enabled=false"]), installed=FIXED)
    assert report.by_rule("MX009").status == "pass"
