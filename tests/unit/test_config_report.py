"""What a config check found (config/report.py): the report as JSON, and the strict error that lists
every error at once."""

from __future__ import annotations

import pytest
from harness.mx_cases import DEFECTIVE, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import ConfigValidationError, validate_config


def test_report_json_round_trip():
    import json

    report = validate_config(
        read_recipe(TINY, ["ddp.overlap_grad_reduce=false"]), strict=False, installed=DEFECTIVE
    )
    data = json.loads(json.dumps(report.as_dict()))
    (rule,) = [r for r in data["rules"] if r["id"] == "MX006"]
    assert rule["status"] == "fail" and rule["findings"][0]["knob"] == "ddp.overlap_grad_reduce"
    assert "overlap_grad_reduce: true" in rule["findings"][0]["fix"]


def test_strict_lists_every_error_at_once():
    overrides = ("ddp.overlap_grad_reduce=false", "mxfp8_plugin.enabled=false", "+ddp.bogus=1")
    with pytest.raises(ConfigValidationError) as exc:
        validate_config(read_recipe(TINY, overrides), installed=DEFECTIVE)
    assert {f.rule for f in exc.value.report.errors} == {"MX006", "MX009", "MX101"}
    for rule in ("MX006", "MX009", "MX101"):
        assert rule in str(exc.value)
