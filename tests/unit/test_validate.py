"""validate_config: every rule from YAML and from megatron-core dataclasses; runtime bucket check."""

from __future__ import annotations

from typing import Any

import pytest
from harness.mx_cases import CASES, DEFECTIVE, FIXED, RECIPES, TINY, Case, core_kwargs

from mbridge_mxfp8_plugin import check_bucket_alignment
from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import (
    RULES,
    ConfigValidationError,
    ValidationReport,
    validate_config,
)
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


# --------------------------------------------------------------------------- runtime: live buckets
def test_check_bucket_alignment_is_the_buckets_one():
    assert check_bucket_alignment is buckets_check
