"""Each config rule alone, through the public ``validate_config(mapping, installed=...)``.

tests/unit/test_validate.py shows every rule fires on its violation; this tier adds that each
violation trips *its* rule and leaves every other rule's status as it was, so a finding names
the knob the user got wrong and nothing else. The recipe is an in-memory mapping (the shipped tiny
recipe as YAML reads it, overrides applied here), so nothing but the rules is under test.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import yaml
from harness.mx_cases import CASES, DEFECTIVE, FIXED, TINY, Case

from mbridge_mxfp8_plugin import validate_config
from mbridge_mxfp8_plugin.probes import HazardBehaviour
from mbridge_mxfp8_plugin.probes.defects import HAZARDS
from mbridge_mxfp8_plugin.probes.fields import section_fields

BASE: dict[str, Any] = yaml.safe_load(TINY.read_text())
# The knobs the tiny recipe leaves to its base recipe, stated here (at Bridge's defaults) so that
# every rule can judge the config: with them unstated a rule says n/a, never pass.
BASE["ddp"]["use_megatron_fsdp"] = False
BASE["optimizer"].update(overlap_param_gather_with_optimizer_step=False, optimizer_cpu_offload=False)
BASE["model"]["num_moe_experts"] = None
if "cuda_graph_impl" in (section_fields("model").fields or {"cuda_graph_impl": None}):
    BASE["model"]["cuda_graph_impl"] = "none"  # a field from megatron-core 0.15
#: a rule tripped at each severity shows this status
TRIPPED = {"error": "fail", "warning": "warn"}
#: one knob, two rules: turning the distributed optimizer off also leaves the recipe's
#: overlap_param_gather without its prerequisite (MX006)
ALSO_TRIPS = {"MX003": {"MX006": "fail"}}


def _apply(overrides: tuple[str, ...]) -> dict[str, Any]:
    """Hydra-style ``[+]a.b=value`` and ``~a.b`` overrides on a copy of the tiny recipe's mapping."""
    cfg = copy.deepcopy(BASE)
    for item in overrides:
        key, _, raw = item.partition("=")
        node = cfg
        *parents, leaf = key.lstrip("+~").split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if key.startswith("~"):
            del node[leaf]
        else:
            node[leaf] = yaml.safe_load(raw)
    return cfg


def _statuses(cfg: dict[str, Any], case: Case, installed: Any) -> dict[str, str]:
    report = validate_config(cfg, dp_size=case.dp_size, strict=False, installed=installed)
    return {r.rule.id: r.status for r in report.results}


@pytest.mark.parametrize("installed", [DEFECTIVE, FIXED], ids=["core0.16", "core0.19"])
def test_tiny_recipe_passes_every_rule(installed):
    report = validate_config(copy.deepcopy(BASE), dp_size=8, strict=False, installed=installed)
    assert report.results and all(r.status == "pass" for r in report.results), report.format_table()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_violation_trips_only_its_rule(case: Case):
    """Other rules may become ``n/a`` (their subject is gone) but none may fire."""
    before = _statuses(copy.deepcopy(BASE), case, DEFECTIVE)
    after = _statuses(_apply(case.overrides), case, case.installed)
    assert before[case.rule] == "pass"
    fired = {r: st for r, st in after.items() if st != before[r] and st != "n/a"}
    assert fired == {case.rule: TRIPPED[case.severity], **ALSO_TRIPS.get(case.rule, {})}


def _hazards(exposed: bool) -> HazardBehaviour:
    """The hazards' probe answers where every hazard applies, or none does."""
    return HazardBehaviour(
        defers_chained_mxfp8_sync=not exposed,
        rejects_step_overlap_with_reuse=not exposed,
        cpu_offload_drops_fp8_params=exposed,
        stages_for_full_iteration_graph=not exposed,
    )


#: A release pair where each hazard applies (core 0.16 + Bridge 0.3) and one where none does
#: (core 0.19 + Bridge 0.6 + a CPU-offload fix no release has yet).
EXPOSED_PAIR = dataclasses.replace(DEFECTIVE, hazards=_hazards(exposed=True))
SAFE_PAIR = dataclasses.replace(FIXED, hazards=_hazards(exposed=False))

#: rule -> (overrides that walk into the hazard, the same config kept safe)
HAZARD_CASES = {
    "MX014": (
        (
            "+model.num_moe_experts=4",
            "ddp.overlap_param_gather=false",
            "optimizer.overlap_param_gather=false",
        ),
        ("+model.num_moe_experts=4",),
    ),
    "MX015": (("+model.cuda_graph_impl=local", "+model.cuda_graph_scope=full_iteration"), ()),
    "MX016": (
        ("+optimizer.optimizer_cpu_offload=true", "+optimizer.use_precision_aware_optimizer=true"),
        ("+optimizer.optimizer_cpu_offload=false", "+optimizer.use_precision_aware_optimizer=true"),
    ),
    "MX007": (("+optimizer.overlap_param_gather_with_optimizer_step=true",), ()),
}


def _hazard_statuses(rule: str, installed: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Every rule's status on the safe config and on the hazard's."""
    if rule == "MX015" and "cuda_graph_impl" not in BASE["model"]:
        pytest.skip("megatron-core < 0.15 has no cuda_graph_impl: no full-iteration graph to ask for")
    hazard, safe = HAZARD_CASES[rule]
    before = validate_config(_apply(safe), dp_size=2, strict=False, installed=installed)
    after = validate_config(_apply(hazard), dp_size=2, strict=False, installed=installed)
    return ({r.rule.id: r.status for r in before.results}, {r.rule.id: r.status for r in after.results})


@pytest.mark.parametrize("rule", sorted(HAZARD_CASES))
def test_hazard_trips_only_its_rule_where_the_pair_is_exposed(rule: str):
    before, after = _hazard_statuses(rule, EXPOSED_PAIR)
    assert before[rule] == "pass"
    assert {r: st for r, st in after.items() if st != before[r] and st != "n/a"} == {rule: "fail"}


@pytest.mark.parametrize("rule", sorted(HAZARD_CASES))
def test_hazard_passes_where_the_pair_is_not_exposed(rule: str):
    """MX007 stays refused: core 0.19 raises for it itself, so the config cannot run either way."""
    before, after = _hazard_statuses(rule, SAFE_PAIR)
    assert after[rule] == ("fail" if rule == "MX007" else "pass")
    assert {r: st for r, st in after.items() if r != rule} == {r: st for r, st in before.items() if r != rule}


def test_hazard_messages_cite_upstream_and_give_the_fix():
    for rule, (overrides, _) in HAZARD_CASES.items():
        if rule == "MX015" and "cuda_graph_impl" not in BASE["model"]:
            continue  # megatron-core < 0.15: no full-iteration graph to ask for
        report = validate_config(_apply(overrides), dp_size=2, strict=False, installed=EXPOSED_PAIR)
        (finding,) = report.by_rule(rule).findings
        assert finding.severity == "error" and finding.fix
        assert HAZARDS[rule].reference.split(" (")[0] in finding.message, finding.message
    mx014 = validate_config(_apply(HAZARD_CASES["MX014"][0]), dp_size=2, strict=False, installed=EXPOSED_PAIR)
    assert mx014.by_rule("MX014").findings[0].fix == {
        "ddp": {"overlap_param_gather": True, "overlap_grad_reduce": True},
        "optimizer": {"overlap_param_gather": True},
    }
    mx007 = validate_config(_apply(HAZARD_CASES["MX007"][0]), dp_size=2, strict=False, installed=SAFE_PAIR)
    assert "rejects it at config time" in mx007.by_rule("MX007").findings[0].message


def test_unprobed_pair_refuses_a_silent_hazard():
    """Without a probe (no megatron-core to read) MoE without overlap is refused, not waved through."""
    report = validate_config(_apply(HAZARD_CASES["MX014"][0]), dp_size=2, strict=False, installed=DEFECTIVE)
    assert report.by_rule("MX014").status == "fail"


def test_cpu_offload_without_precision_aware_optimizer_is_a_warning():
    cfg = _apply(("+optimizer.optimizer_cpu_offload=true", "+optimizer.use_precision_aware_optimizer=false"))
    report = validate_config(cfg, dp_size=2, strict=False, installed=EXPOSED_PAIR)
    assert [(f.rule, f.severity) for f in report.findings] == [("MX016", "warning")]
