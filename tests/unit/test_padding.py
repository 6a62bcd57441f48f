"""MX008 (config/rules/padding.py): the distributed optimizer pads buckets for the data-parallel size;
the rule needs that size, checks the expert groups, and reports wasteful padding with numbers."""

from __future__ import annotations

from harness.check_io import findings as _findings
from harness.mx_cases import DEFECTIVE, RECIPES, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config


def test_padding_rule_needs_dp_and_checks_expert_groups():
    data = read_recipe(RECIPES[[p.name for p in RECIPES].index("qwen3_30b_a3b_mxfp8_pretrain.yaml")])
    assert validate_config(data, installed=DEFECTIVE).by_rule("MX008").status == "n/a"
    ok = validate_config(data, dp_size=8, installed=DEFECTIVE).by_rule("MX008")
    assert ok.status == "pass" and "expert bucket ends padded" in ok.note
    bad = validate_config(
        read_recipe(RECIPES[1], ["model.expert_model_parallel_size=3"]),
        dp_size=8,
        strict=False,
        installed=DEFECTIVE,
    )
    assert [(f.rule, f.knob) for f in bad.errors] == [("MX008", "model.expert_model_parallel_size")]


def test_padding_waste_is_a_warning_with_numbers():
    report = validate_config(
        read_recipe(TINY, ["+ddp.pad_buckets_for_high_nccl_busbw=true", "ddp.bucket_size=40000000"]),
        dp_size=1000,
        strict=False,
        installed=DEFECTIVE,
    )
    (f,) = _findings(report, "MX008")
    assert f.severity == "warning" and f.knob == "ddp.pad_buckets_for_high_nccl_busbw"
    assert "8192000" in f.message  # lcm(1000, 128, 2**16)
