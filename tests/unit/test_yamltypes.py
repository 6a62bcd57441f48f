"""Judging a YAML value against its field's type (common/yamltypes.py), through ``check`` on the
installed Bridge's annotations: a seeded type or value error is one clear MX102 line, and the values
the annotations allow pass."""

from __future__ import annotations

import pytest
from harness.check_io import EXACT as DATA
from harness.check_io import lines as _lines
from harness.check_io import needs_bridge
from harness.check_io import rule as _rule
from harness.check_io import run as _run

SEEDED = [
    ("train.train_iters=ten", "train.train_iters", "an integer"),
    ("train.skip_train=yes", "train.skip_train", "a boolean"),
    ("checkpoint.save_interval=abc", "checkpoint.save_interval", "an integer"),
    ("mixed_precision.fp8_recipe=mxfp9", "mixed_precision.fp8_recipe", "did you mean 'mxfp8'"),
    ("mxfp8_plugin.verify_sample=2.0", "mxfp8_plugin.verify_sample", "a number in (0, 1]"),
    ("+model.attention_backend=flsh", "model.attention_backend", "did you mean 'flash'"),
]


@needs_bridge
@pytest.mark.parametrize(("override", "knob", "expected"), SEEDED, ids=[s[1] for s in SEEDED])
def test_seeded_type_and_value_errors_are_one_clear_line(override, knob, expected):
    clean = _run(DATA / "mp_mapping.yaml")
    assert clean[0] == 0, clean[1]
    code, out, err = _run(DATA / "mp_mapping.yaml", [override])
    assert code == 1, out
    (line,) = _lines(out, "error ")
    value = override.split("=", 1)[1]
    assert line.startswith(f"error MX102 {knob}:") and expected in line, line
    assert f"got {value}" in line.replace("'", ""), line
    assert err.count("\n") == 1 and knob in err
    code, result = _rule(DATA / "mp_mapping.yaml", "MX102", [override])
    assert code == 1 and result["status"] == "fail"
    assert [f["knob"] for f in result["findings"]] == [knob] and expected in result["findings"][0]["message"]


@needs_bridge
def test_values_the_annotations_allow_pass():
    ok = ["train.train_iters=10", "train.skip_train=true", "+model.attention_backend=flash"]
    ok += ["mixed_precision.fp8_recipe=delayed", "mxfp8_plugin.verify_sample=1.0"]
    code, out, _ = _run(DATA / "mp_mapping.yaml", ok)
    assert code == 0 and not _lines(out, "error"), out
