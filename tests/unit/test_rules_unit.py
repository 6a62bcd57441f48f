"""Each config rule alone, through the public ``validate_config(mapping, installed=...)``.

tests/test_validate.py shows every rule fires on its violation; this tier adds that each
violation trips *its* rule and leaves every other rule's status as it was, so a finding names
the knob the user got wrong and nothing else. The recipe is an in-memory mapping (the shipped tiny
recipe as YAML reads it, overrides applied here), so nothing but the rules is under test.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from harness.mx_cases import CASES, DEFECTIVE, FIXED, TINY, Case

from mbridge_mxfp8_plugin import validate_config

BASE: dict[str, Any] = yaml.safe_load(TINY.read_text())
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
