"""validate_config: every rule from YAML and from megatron-core dataclasses; runtime bucket check."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from harness.mx_cases import CASES, DEFECTIVE, FIXED, RECIPES, TINY, Case, core_configs, core_kwargs

from mbridge_mxfp8_plugin import check_bucket_alignment
from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import (
    RULES,
    ConfigValidationError,
    InstalledStack,
    ValidationReport,
    validate_config,
)
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError, MXFP8UsageError
from mbridge_mxfp8_plugin.mcore.buckets import check_bucket_alignment as buckets_check
from mbridge_mxfp8_plugin.probes.defects import HAZARDS


def _findings(report: ValidationReport, rule: str) -> list[Any]:
    return [f for f in report.findings if f.rule == rule]


# --------------------------------------------------------------------------- shipped recipes
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("installed", [DEFECTIVE, FIXED], ids=["core0.16", "core0.19"])
def test_shipped_recipes_pass_every_rule(recipe, installed):
    """Every rule passes, or says n/a because a knob it needs is left to the base recipe (a pass
    there would vouch for a value check never saw)."""
    report = validate_config(read_recipe(recipe), dp_size=8, installed=installed)
    assert report.ok and not report.warnings, report.format_table()
    assert {r.rule.id for r in report.results} == {r.id for r in RULES}
    for r in report.results:
        assert r.status == "pass" or (
            r.status == "n/a" and ("not set in this recipe" in r.note or "base config" in r.note)
        ), report.format_table()


def test_every_rule_has_a_violation_case():
    """The hazard rules' cases need a release pair that is exposed: tests/unit/test_hazards.py (real
    containers, every matrix cell) and tests/unit/test_rules_unit.py (both kinds of pair)."""
    assert {c.rule for c in CASES} | set(HAZARDS) == {r.id for r in RULES}


# --------------------------------------------------------------------------- one violation per rule
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_fires_on_yaml(case: Case):
    base = validate_config(read_recipe(TINY), dp_size=case.dp_size, strict=False, installed=DEFECTIVE)
    # the unmodified recipe passes this rule, or leaves its knob to the base recipe
    assert base.by_rule(case.rule).status in ("pass", "n/a"), base.format_table()
    report = validate_config(
        read_recipe(TINY, case.overrides), dp_size=case.dp_size, strict=False, installed=case.installed
    )
    found = _findings(report, case.rule)
    assert found, report.format_table()
    assert any(case.knob in f.knob and f.severity == case.severity for f in found), found
    assert all(f.message and f.fix_yaml for f in found), "every finding says why and how to fix it"
    if case.severity == "error":
        with pytest.raises(ConfigValidationError) as exc:
            validate_config(read_recipe(TINY, case.overrides), dp_size=case.dp_size, installed=case.installed)
        assert case.rule in str(exc.value) and case.knob in str(exc.value)


@pytest.mark.parametrize("case", [c for c in CASES if c.core is not None], ids=lambda c: c.id)
def test_rule_fires_on_megatron_core_configs(case: Case):
    base = validate_config(
        **core_kwargs(Case("base", "", "", (), {})), dp_size=case.dp_size, strict=False, installed=DEFECTIVE
    )
    assert base.ok and not base.warnings, base.format_table()
    report = validate_config(
        **core_kwargs(case), dp_size=case.dp_size, strict=False, installed=case.installed
    )
    knob, severity = case.core_knob or case.knob, case.core_severity or case.severity
    found = _findings(report, case.rule)
    assert any(knob in f.knob and f.severity == severity for f in found), report.format_table()


def test_tuple_and_keyword_forms_agree():
    kw = core_configs({"overlap_grad_reduce": False})
    a = validate_config(kw["ddp"], strict=False, installed=DEFECTIVE)  # ddp config alone
    b = validate_config((kw["ddp"], kw["optimizer"]), strict=False, installed=DEFECTIVE)
    c = validate_config(ddp=kw["ddp"], optimizer=kw["optimizer"], strict=False, installed=DEFECTIVE)
    for r in (a, b, c):
        assert [f.rule for f in r.errors] == ["MX006"]
    with pytest.raises(MXFP8UsageError):
        validate_config(kw["ddp"], optimizer=kw["optimizer"])
    with pytest.raises(MXFP8UsageError, match="DistributedDataParallelConfig"):
        validate_config((kw["optimizer"],))
    with pytest.raises(MXFP8UsageError):
        validate_config(object())


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


def test_strict_lists_every_error_at_once():
    overrides = ("ddp.overlap_grad_reduce=false", "mxfp8_plugin.enabled=false", "+ddp.bogus=1")
    with pytest.raises(ConfigValidationError) as exc:
        validate_config(read_recipe(TINY, overrides), installed=DEFECTIVE)
    assert {f.rule for f in exc.value.report.errors} == {"MX006", "MX009", "MX101"}
    for rule in ("MX006", "MX009", "MX101"):
        assert rule in str(exc.value)


def test_wrong_type_does_not_cascade():
    """A mistyped knob is one error; rules that read it treat it as unknown, not as truthy."""
    report = validate_config(
        read_recipe(TINY, ["ddp.use_distributed_optimizer='false'"]), strict=False, installed=DEFECTIVE
    )
    assert [f.rule for f in report.errors] == ["MX102"]
    assert "must be a boolean" in report.errors[0].message and "'false'" in report.errors[0].message


def test_unknown_key_suggests_the_right_one():
    report = validate_config(
        {"dpp": {}, "ddp": {"overlap_param_gathr": True}}, strict=False, installed=DEFECTIVE
    )
    msgs = " ".join(f.message for f in _findings(report, "MX101"))
    assert "did you mean 'ddp'" in msgs and "did you mean 'overlap_param_gather'" in msgs


def test_plugin_section_is_checked():
    report = validate_config(
        read_recipe(TINY, ["+mxfp8_plugin.prestge=false", "mxfp8_plugin.strict=1"]),
        strict=False,
        installed=DEFECTIVE,
    )
    assert {(f.rule, f.knob) for f in report.errors} == {
        ("MX101", "mxfp8_plugin.prestge"),
        ("MX102", "mxfp8_plugin.strict"),
    }


def test_mixed_precision_names_accept_hyphens_like_bridge():
    report = validate_config(
        read_recipe(TINY, ["mixed_precision=bf16-with-mxfp8-mixed"]), installed=DEFECTIVE
    )
    assert report.ok


def test_plugin_off_is_fine_where_core_has_no_defects():
    report = validate_config(read_recipe(TINY, ["mxfp8_plugin.enabled=false"]), installed=FIXED)
    assert report.by_rule("MX009").status == "pass"


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


# --------------------------------------------------------------------------- Bridge ConfigContainer
def _container(**overrides: Any) -> SimpleNamespace:
    """Duck-typed ConfigContainer (Bridge cannot be imported here) holding real megatron-core configs."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        )
        opt = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, overlap_param_gather=True)
    cfg = SimpleNamespace(
        ddp=ddp,
        optimizer=opt,
        model=SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1),
        dist=SimpleNamespace(use_megatron_fsdp=False),
        mixed_precision="bf16_with_mxfp8_mixed",
        train=SimpleNamespace(eval_interval=10),
        checkpoint=SimpleNamespace(save_interval=100),
        data_parallel_size=4,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def test_bridge_container_mixed_precision_owns_the_knobs():
    """Before runtime_config_update, ddp still holds core defaults (reuse off): not a conflict."""
    report = validate_config(_container(), installed=DEFECTIVE)
    assert report.kind == "bridge" and report.ok and report.dp_size == 4
    assert report.by_rule("MX001").status == "pass" and report.by_rule("MX005").status == "pass"


def test_bridge_container_with_resolved_mixed_precision_object():
    @dataclasses.dataclass
    class MP:  # the fields of Bridge's MixedPrecisionConfig that matter here
        fp8: str = "e4m3"
        fp8_recipe: str = "mxfp8"
        fp8_param_gather: bool = True
        reuse_grad_buf_for_mxfp8_param_ag: bool = False

    report = validate_config(_container(mixed_precision=MP()), strict=False, installed=DEFECTIVE)
    assert [(f.rule, f.knob) for f in report.errors] == [
        ("MX001", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag")
    ]


def test_bridge_container_unknown_recipe_name_and_fsdp():
    report = validate_config(
        _container(mixed_precision="bf16_with_mxfp9_mixed"), strict=False, installed=DEFECTIVE
    )
    assert [f.rule for f in report.errors] == ["MX103"]
    report = validate_config(
        _container(dist=SimpleNamespace(use_megatron_fsdp=True)), strict=False, installed=DEFECTIVE
    )
    assert [(f.rule, f.severity, f.knob) for f in _findings(report, "MX004")] == [
        ("MX004", "warning", "dist.use_megatron_fsdp")
    ]


def test_installed_stack_probe_matches_this_core():
    """check reads the installed core from its files; the engine decides from the imported
    classes. On this core both must say the same."""
    from mbridge_mxfp8_plugin.probes import probe_bucket_offsets, probe_core

    stack = InstalledStack.detect()
    assert stack.core == probe_core()
    assert stack.core is not None and stack.core.pads_bucket_offsets == probe_bucket_offsets()
    assert ("B1" in stack.defects) == (not stack.core.forced_sync_writes_back)
    assert ("C" in stack.defects) == (not stack.core.has_dispatch_reset)


def test_report_json_round_trip():
    import json

    report = validate_config(
        read_recipe(TINY, ["ddp.overlap_grad_reduce=false"]), strict=False, installed=DEFECTIVE
    )
    data = json.loads(json.dumps(report.as_dict()))
    (rule,) = [r for r in data["rules"] if r["id"] == "MX006"]
    assert rule["status"] == "fail" and rule["findings"][0]["knob"] == "ddp.overlap_grad_reduce"
    assert "overlap_grad_reduce: true" in rule["findings"][0]["fix"]


# --------------------------------------------------------------------------- runtime: live buckets
def test_check_bucket_alignment_is_the_buckets_one():
    assert check_bucket_alignment is buckets_check
