"""MX101-MX103: problems with the input itself, found while reading it (:mod:`..view`).

The reader records what kind of problem it saw; the rule ids are given here, in one place.
"""

from __future__ import annotations

from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult
from ..view import IssueKind
from ._base import _found, _na, _pass, _rule


def _input_rule(rule_id: str, kind: IssueKind, title: str, ok_note: str) -> None:
    @_rule(rule_id, title)
    def check(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
        issues = [i for i in ctx.view.issues if i.kind == kind]
        unchecked = ctx.view.unchecked_sections if kind == "unknown_key" else []
        if not issues and unchecked:
            # Vouch only for what was read against a class: the rest is listed, not passed.
            names = ", ".join(f"{s}.*" for s in sorted(set(unchecked)))
            return _na(rule, f"keys of {names} not checked (see below); no unknown key in the others")
        if not issues:
            return _pass(rule, ok_note)
        return _found(rule, (Finding(rule_id, "error", i.knob, i.value, i.message, i.fix) for i in issues))


_input_rule("MX101", "unknown_key", "known sections and keys", "every section and key exists")
_input_rule("MX102", "wrong_type", "knob types", "every knob has the right type")
_input_rule(
    "MX103",
    "unknown_recipe",
    "mixed-precision recipe name",
    "mixed_precision names a Bridge recipe (or is not set)",
)
