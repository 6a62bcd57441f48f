"""MX001-MX007, MX012, MX013 (config/rules/combination.py): knob combinations megatron-core or Bridge
reject, or accept and train wrong; each finding says what is stated and how to fix it."""

from __future__ import annotations

import pytest
import yaml
from harness.check_io import DATA
from harness.check_io import findings as _findings
from harness.check_io import run_json as _json
from harness.check_io import status as _status
from harness.mx_cases import DEFECTIVE, FIXED, TINY, core_configs

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError


def test_megatron_core_assert_becomes_a_clear_error():
    """megatron-core asserts reuse => fp8_param_gather at construction; the validator explains it."""
    from megatron.core.distributed import DistributedDataParallelConfig

    with pytest.raises(AssertionError):
        DistributedDataParallelConfig(reuse_grad_buf_for_mxfp8_param_ag=True, fp8_param_gather=False)
    kw = core_configs({"fp8_param_gather": False})
    with pytest.raises(MXFP8ConfigError) as exc:
        validate_config(**kw, installed=DEFECTIVE)
    text = str(exc.value)
    assert "MX002 ddp.fp8_param_gather" in text and "fp8_param_gather: true" in text


def test_mp_overwrite_without_stated_mixed_precision_warns():
    """A recipe setting reuse only under ddp: every Bridge recipe's mixed_precision resets it."""
    data = read_recipe(TINY, ["~mixed_precision"])
    report = validate_config(data, strict=False, installed=DEFECTIVE)
    warned = {f.knob for f in _findings(report, "MX005") if f.severity == "warning"}
    assert "ddp.reuse_grad_buf_for_mxfp8_param_ag" in warned and "ddp.fp8_param_gather" in warned
    # ...but not when the recipe explicitly replaces the base's mixed_precision with null.
    report = validate_config(read_recipe(TINY, ["mixed_precision=null"]), strict=False, installed=DEFECTIVE)
    assert not _findings(report, "MX005")


def test_overlap_mismatch_direction_matters():
    only_opt = validate_config(**core_configs({"overlap_param_gather": False}), strict=False, installed=FIXED)
    only_ddp = validate_config(
        **core_configs(opt={"overlap_param_gather": False}), strict=False, installed=FIXED
    )
    assert [(f.severity, f.knob) for f in _findings(only_opt, "MX005")] == [
        ("error", "ddp.overlap_param_gather")
    ]
    assert [(f.severity, f.knob) for f in _findings(only_ddp, "MX005")] == [
        ("warning", "optimizer.overlap_param_gather")
    ]


def test_mx004_fix_clears_the_finding(tmp_path):
    code, report = _json(DATA / "fsdp_in_dist.yaml")
    (finding,) = [f for r in report["rules"] for f in r["findings"] if r["id"] == "MX004"]
    fix = yaml.safe_load(finding["fix"])
    data = yaml.safe_load((DATA / "fsdp_in_dist.yaml").read_text())
    for section, knobs in fix.items():
        data.setdefault(section, {}).update(knobs)
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump(data))
    code, report = _json(fixed)
    assert _status(report)["MX004"] == "pass", report


def test_stated_false_is_not_called_unset():
    code, report = _json(DATA / "comm_overlap_stated_false.yaml")
    (finding,) = [f for r in report["rules"] for f in r["findings"] if r["id"] == "MX013"]
    assert "ddp.overlap_param_gather is stated false, but comm_overlap overwrites it" in finding["message"]
    assert "not set" not in finding["message"]
    assert _status(report)["MX006"] == "n/a"  # unknown: neither "off" nor a pass
    code, report = _json(DATA / "comm_overlap_stated_false.yaml", dp_size=8)
    assert _status(report)["MX013"] == "pass"  # with the dp size, comm_overlap's default is known


def test_mx006_says_stated_false_when_it_is(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("ddp:\n  overlap_param_gather: false\n")
    _, report = _json(path)
    (mx006,) = [r for r in report["rules"] if r["id"] == "MX006"]
    assert mx006["status"] == "pass" and mx006["note"] == "overlap_param_gather stated false"
    path.write_text("ddp:\n  use_distributed_optimizer: true\n")
    _, report = _json(path)
    (mx006,) = [r for r in report["rules"] if r["id"] == "MX006"]
    assert mx006["status"] == "n/a" and "not set in this recipe" in mx006["note"]
