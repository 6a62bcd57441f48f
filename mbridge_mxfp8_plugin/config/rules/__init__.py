"""The config rules, grouped by what they protect; this module is their registry.

* :mod:`.input` (MX101-MX103): the file itself - unknown keys, wrong types, recipe names.
* :mod:`.combination` (MX001-MX007, MX012, MX013): knob combinations that megatron-core or
  Bridge reject, or accept and then train wrong.
* :mod:`.padding` (MX008): the distributed optimizer's bucket padding for a dp size.
* :mod:`.release` (MX009-MX011): what the *installed* release pair needs (the defect table).

Each rule reads knobs only through :class:`..view.EffectiveConfig` (Bridge's precedence applied
once, in one place) and returns one :class:`..report.RuleResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult, Severity, Status
from ..view import UNKNOWN

__all__ = ["RULES", "run_rules"]

RuleFn = Callable[[EffectiveConfig], RuleResult]
_REGISTRY: list[tuple[Rule, RuleFn]] = []


def _rule(rule_id: str, title: str) -> Callable[[Callable[[EffectiveConfig, Rule], RuleResult]], RuleFn]:
    def deco(fn: Callable[[EffectiveConfig, Rule], RuleResult]) -> RuleFn:
        rule = Rule(rule_id, title)

        def run(ctx: EffectiveConfig) -> RuleResult:
            return fn(ctx, rule)

        _REGISTRY.append((rule, run))
        return run

    return deco


def _pass(rule: Rule, note: str, knob: str = "", value: Any = UNKNOWN) -> RuleResult:
    return RuleResult(rule, "pass", note=note, knob=knob, value=value)


def _na(rule: Rule, note: str, knob: str = "") -> RuleResult:
    return RuleResult(rule, "n/a", note=note, knob=knob)


def _found(rule: Rule, findings: Iterable[Finding], knob: str = "", value: Any = UNKNOWN) -> RuleResult:
    fs = list(findings)
    status: Status = "fail" if any(f.severity == "error" for f in fs) else ("warn" if fs else "pass")
    return RuleResult(rule, status, fs, knob=knob, value=value)


def _violation(
    rule: Rule, severity: Severity, knob: str, value: Any, message: str, fix: Any = None
) -> RuleResult:
    """The common case: a rule that found exactly one problem."""
    return _found(rule, [Finding(rule.id, severity, knob, value, message, fix)])


def run_rules(ctx: EffectiveConfig) -> list[RuleResult]:
    """Every rule's verdict, in rule-id order."""
    return [fn(ctx) for _, fn in sorted(_REGISTRY, key=lambda item: item[0].id)]


from . import combination, input, padding, release  # noqa: E402,F401,A004 - registers the rules

RULES: tuple[Rule, ...] = tuple(sorted((r for r, _ in _REGISTRY), key=lambda r: r.id))
