"""MX101-MX103 (config/rules/inputs.py): problems with the input itself. A mistyped knob is one MX102
error that does not cascade; a mixed-precision recipe name is MX103 where it is unknown, and not a
pass where it could not be looked up."""

from __future__ import annotations

from harness.check_io import EXACT as DATA
from harness.check_io import rule as _rule
from harness.check_io import run as _run
from harness.mx_cases import DEFECTIVE, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config


def test_wrong_type_does_not_cascade():
    """A mistyped knob is one error; rules that read it treat it as unknown, not as truthy."""
    report = validate_config(
        read_recipe(TINY, ["ddp.use_distributed_optimizer='false'"]), strict=False, installed=DEFECTIVE
    )
    assert [f.rule for f in report.errors] == ["MX102"]
    assert "must be a boolean" in report.errors[0].message and "'false'" in report.errors[0].message


def test_mx103_does_not_pass_a_name_it_could_not_look_up(monkeypatch):
    import mbridge_mxfp8_plugin.config.sections as sections

    monkeypatch.setattr(sections, "bridge_facts", lambda: None)
    code, result = _rule(DATA / "moe_reuse_no_overlap.yaml", "MX103")
    assert result["status"] == "n/a" and "not looked up" in result["note"], result


def test_unknown_target_recipe_name_is_mx103(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("mixed_precision:\n  _target_: megatron.bridge.training.mixed_precision.bf16_mxfp8\n")
    code, out, _ = _run(path)
    assert code == 1 and "error MX103 mixed_precision._target_" in out and "bf16_with_mxfp8_mixed" in out
