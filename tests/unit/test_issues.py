"""How a problem in the input is worded (config/issues.py): an unknown key or section suggests the
right one, a renamed section gets the same advice everywhere."""

from __future__ import annotations

from harness.check_io import EXACT as DATA
from harness.check_io import findings as _findings
from harness.check_io import lines as _lines
from harness.check_io import run as _run
from harness.mx_cases import DEFECTIVE

from mbridge_mxfp8_plugin.config.validate import validate_config


def test_unknown_key_suggests_the_right_one():
    report = validate_config(
        {"dpp": {}, "ddp": {"overlap_param_gathr": True}}, strict=False, installed=DEFECTIVE
    )
    msgs = " ".join(f.message for f in _findings(report, "MX101"))
    assert "did you mean 'ddp'" in msgs and "did you mean 'overlap_param_gather'" in msgs


def test_every_renamed_config_section_gets_the_same_advice():
    code, out, _ = _run(DATA / "renamed_sections.yaml")
    assert code == 1
    lines = _lines(out, "error MX101")
    assert len(lines) == 3
    for old, new in (
        ("model_config", "model"),
        ("train_config", "train"),
        ("checkpoint_config", "checkpoint"),
    ):
        (line,) = [ln for ln in lines if f" {old}:" in ln]
        assert f"Rename it to {new}" in line and "'_config' suffix" in line, line
    assert "# rename section model_config: to model:" in out
