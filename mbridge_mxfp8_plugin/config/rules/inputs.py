"""MX101-MX103: problems with the input itself, found while reading it (:mod:`..sections`).

The reader records what kind of problem it saw and how sure it is (an unknown key is an error
only where the class Bridge builds is known); the rule ids are given here, in one place. A pass
vouches only for what was checked: sections whose keys could not be read against a class, and
recipe names with no registry to check them against, are ``n/a`` with the reason.
"""

from __future__ import annotations

from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult
from ..values import IssueKind
from ._base import _found, _na, _pass, _rule


def _issues(ctx: EffectiveConfig, rule: Rule, kind: IssueKind) -> RuleResult | None:
    issues = [i for i in ctx.view.issues if i.kind == kind]
    if not issues:
        return None
    return _found(rule, (Finding(rule.id, i.severity, i.knob, i.value, i.message, i.fix) for i in issues))


@_rule("MX101", "known sections and keys")
def _mx101(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    # Vouch only for what was read against a class: the rest is listed, not passed.
    names = ", ".join(f"{s}.*" for s in sorted(set(ctx.view.unchecked_sections)))
    return _read_against_classes(
        ctx, rule, "unknown_key",
        f"keys of {names} not checked (see below); no unknown key in the others",
        "every section and key is a field of the class Bridge builds",
    )  # fmt: skip


@_rule("MX102", "knob types and values")
def _mx102(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    return _read_against_classes(
        ctx, rule, "wrong_type",
        "values of sections whose class is unreadable here were not checked (see below)",
        "every value fits its field's type in the installed release",
    )  # fmt: skip


def _read_against_classes(
    ctx: EffectiveConfig, rule: Rule, kind: IssueKind, not_read: str, ok: str
) -> RuleResult:
    """What the reader found of ``kind``; else n/a where a section's class was unreadable."""
    found = _issues(ctx, rule, kind)
    if found is not None:
        return found
    return _na(rule, not_read) if ctx.view.unchecked_sections else _pass(rule, ok)


@_rule("MX103", "mixed-precision recipe name")
def _mx103(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    found = _issues(ctx, rule, "unknown_recipe")
    if found is not None:
        return found
    if ctx.view.mp_name is None:
        return _pass(rule, "mixed_precision names no recipe here (nothing to look up)")
    if not ctx.view.recipe_names_checked:
        # A name we know from the written facts may still be missing from the release the job runs.
        return _na(rule, f"{ctx.view.mp_name!r} not looked up: no Bridge registry here (see below)")
    return _pass(rule, f"{ctx.view.mp_name!r} is registered in the installed Bridge")
