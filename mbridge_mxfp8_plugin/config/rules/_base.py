"""The rule registry and the helpers every rule builds its verdict with.

A rule is a function ``(EffectiveConfig, Rule) -> RuleResult`` registered with :func:`_rule`;
the registry knows nothing of any particular rule, so the rule modules import it, never the
package that lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult, Severity, Status
from ..view import UNKNOWN, Val

__all__ = ["REGISTRY", "RuleFn", "run_rules"]

RuleFn = Callable[[EffectiveConfig], RuleResult]
REGISTRY: list[tuple[Rule, RuleFn]] = []


def _rule(rule_id: str, title: str) -> Callable[[Callable[[EffectiveConfig, Rule], RuleResult]], RuleFn]:
    def deco(fn: Callable[[EffectiveConfig, Rule], RuleResult]) -> RuleFn:
        rule = Rule(rule_id, title)

        def run(ctx: EffectiveConfig) -> RuleResult:
            return fn(ctx, rule)

        REGISTRY.append((rule, run))
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
    return [fn(ctx) for _, fn in sorted(REGISTRY, key=lambda item: item[0].id)]


def _settled(rule: Rule, v: Val, name: str, on_note: str) -> RuleResult | None:
    """The verdict when knob ``v`` alone decides it: n/a while the base config decides it, pass
    when it is on; None when it is off and the rule must say why that is wrong."""
    if not v.known:
        return _na(rule, f"{name} comes from the base config", v.path)
    if v.value:
        return _pass(rule, on_note, v.path, True)
    return None
