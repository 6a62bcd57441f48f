"""validate_config: every rule from YAML and from megatron-core dataclasses; runtime bucket check."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from harness.mx_cases import CASES, DEFECTIVE, FIXED, RECIPES, TINY, Case, core_configs, core_kwargs

from mbridge_mxfp8_plugin import check_bucket_alignment
from mbridge_mxfp8_plugin.buckets import check_bucket_alignment as buckets_check
from mbridge_mxfp8_plugin.config.validate import (
    RULES,
    ConfigValidationError,
    InstalledStack,
    ValidationReport,
    validate_config,
)
from mbridge_mxfp8_plugin.defects import HAZARDS
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError, MXFP8UsageError
from mbridge_mxfp8_plugin.recipes import read_recipe


def _findings(report: ValidationReport, rule: str) -> list[Any]:
    return [f for f in report.findings if f.rule == rule]


# --------------------------------------------------------------------------- shipped recipes
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("installed", [DEFECTIVE, FIXED], ids=["core0.16", "core0.19"])
def test_shipped_recipes_pass_every_rule(recipe, installed):
    report = validate_config(read_recipe(recipe), dp_size=8, installed=installed)
    assert report.ok and not report.warnings, report.format_table()
    assert {r.rule.id for r in report.results} == {r.id for r in RULES}
    assert all(r.status == "pass" for r in report.results), report.format_table()


def test_every_rule_has_a_violation_case():
    """The hazard rules' cases need a release pair that is exposed: tests/test_hazards.py (real
    containers, every matrix cell) and tests/unit/test_rules_unit.py (both kinds of pair)."""
    assert {c.rule for c in CASES} | set(HAZARDS) == {r.id for r in RULES}


# --------------------------------------------------------------------------- one violation per rule
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_fires_on_yaml(case: Case):
    base = validate_config(read_recipe(TINY), dp_size=case.dp_size, strict=False, installed=DEFECTIVE)
    assert base.by_rule(case.rule).status == "pass", "the unmodified recipe must pass this rule"
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


_LAYOUT_DIMS = (32, 45, 45, 45, 45, 10)  # no weight numel is a multiple of 64
_EXPERT_LAYERS = (2, 3)


def _offsets(model: list[Any]) -> list[dict[str, Any]]:
    """Per param: megatron-core's ``param_to_index``, the padded truth, and the naive running sum."""
    from mbridge_mxfp8_plugin.buckets import iter_buckets

    names = {p: n for n, p in model[0].named_parameters()}
    rows = []
    for info in iter_buckets(model):
        bucket, buffer = info.bucket_obj, info.buffer_obj
        naive = 0
        for p in bucket.params_list:
            start, end, _ = buffer.param_index_map[p]
            rows.append(
                {
                    "name": names[p],
                    "expert": info.expert,
                    "found": tuple(bucket.param_to_index[p]),
                    "truth": (start - bucket.offset, end - bucket.offset),
                    "naive": (naive, naive + p.numel()),
                }
            )
            naive += p.numel()
    return rows


def _alignment_rank() -> dict[bool, dict[str, Any]]:
    """Build the toy (dense + expert-parallel layers) on real megatron-core, check, then run
    megatron-core's own non-overlapped param sync, whose MXFP8 copy-back reads ``param_to_index``.

    Once without and once with the repair, each on a freshly built job, in one rank launch (process
    start-up and imports are most of this test's time, in the main tier and in every matrix cell)."""
    return {repair: _alignment_case(repair) for repair in (False, True)}


def _alignment_case(repair: bool) -> dict[str, Any]:
    import torch

    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    warnings.filterwarnings("ignore")
    with cpu_shim(), emulated_mxfp8():
        toy = ToyConfig(
            dims=_LAYOUT_DIMS,
            overlap_param_gather=False,
            expert_layers=_EXPERT_LAYERS,
            expert_model_parallel_size=2,
        )
        job = build_job(toy)
        chunk = job.model[0]
        before_rows = _offsets(job.model)
        weights = {n: p.detach().float().clone() for n, p in chunk.named_parameters()}
        report = check_bucket_alignment(job.model, repair=repair)
        after_rows = _offsets(job.model)
        chunk.zero_grad_buffer()
        for opt in job.optimizer.chained_optimizers:
            opt._copy_main_params_to_param_buffer()  # stage exactly the current weights
        chunk.start_param_sync()  # all-gather + copy-back into the params
        wrong = sorted(
            n for n, p in chunk.named_parameters() if not torch.equal(p.detach().float(), weights[n])
        )
        return {
            "n_dense": len(chunk.buffers),
            "n_expert": len(chunk.expert_parallel_buffers),
            "before": before_rows,
            "after": after_rows,
            "mismatches": sorted(m.param for m in report.mismatches),
            "wrong_after_sync": wrong,
        }


@pytest.fixture(scope="module")
def alignment_results() -> dict[bool, dict[str, Any]]:
    from mbridge_mxfp8_plugin.testing import launch

    return launch(_alignment_rank, 2)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("repair", [False, True], ids=["probe-only", "repair"])
def test_bucket_alignment_on_real_dense_and_expert_buffers(alignment_results, repair):
    """Parametrised by the installed megatron-core, judged against ``buffer.param_index_map`` only.

    If megatron-core's offsets are the naive running sum (defect A), the check must report exactly
    those params, ``repair`` must make them equal to the padded truth, and the real copy-back must
    then write every weight back unchanged (and must not without the repair - the defect is real).
    If the offsets already equal the truth, there is nothing to repair and nothing goes wrong.
    """
    res = alignment_results[repair]
    assert res["n_dense"] >= 1 and res["n_expert"] >= 1, "toy must have dense and expert-parallel buffers"
    before = res["before"]
    for kind in (False, True):
        rows = [r for r in before if r["expert"] is kind]
        assert any(r["naive"] != r["truth"] for r in rows), "layout must be one where padding matters"
    off = sorted(r["name"] for r in before if r["found"] != r["truth"])
    if off:  # defect A present: every wrong offset must be the naive one
        assert all(r["found"] == r["naive"] for r in before if r["found"] != r["truth"])
        assert {r["expert"] for r in before if r["found"] != r["truth"]} == {False, True}
        assert res["mismatches"] == off
        if repair:
            assert all(r["found"] == r["truth"] for r in res["after"])
            assert res["wrong_after_sync"] == []
        else:
            assert res["after"] == before
            assert res["wrong_after_sync"], "unrepaired offsets must corrupt the copy-back"
    else:  # defect absent: nothing reported, nothing changed, nothing corrupted
        assert res["mismatches"] == [] and res["after"] == before
        assert res["wrong_after_sync"] == []
