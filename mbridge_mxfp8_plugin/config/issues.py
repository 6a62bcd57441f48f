"""How a problem in the input is worded: one line naming the knob, the value and what it must be,
plus a YAML snippet that fixes it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..common.yamltypes import closest, example_value, suggest, type_problem, yaml_literal
from ..options import PLUGIN_SECTION
from ..probes.bridge_facts import RENAMED_SECTIONS, dtype_name_problem
from .values import ConfigView, InputIssue

__all__ = ["check_value", "issue_type", "unknown_key", "unknown_section"]


def _unquoted(value: Any, annotation: Any) -> str | None:
    """The value meant when a number or boolean was quoted (``'1e-4'`` -> ``0.0001``)."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    as_bool = {"true": True, "false": False}
    for kind, parse in ((bool, lambda t: as_bool[t.lower()]), (int, int), (float, float)):
        try:
            parsed = parse(text)
        except (KeyError, ValueError):
            continue
        if type_problem(parsed, annotation, dtype_name_problem) is None:
            return f"{yaml_literal(parsed)}  # unquoted" if kind is not bool else yaml_literal(parsed)
    return None


def issue_type(view: ConfigView, path: str, value: Any, expected: str, annotation: Any = None) -> None:
    """Record a wrongly typed value, with a fix of the right type (the unquoted value when the
    user quoted a number or boolean)."""
    *parents, leaf = path.split(".")
    example = "{...}" if annotation is None else _unquoted(value, annotation) or example_value(annotation)
    fix = (
        "\n".join(f"{'  ' * i}{p}:" for i, p in enumerate(parents))
        + f"\n{'  ' * len(parents)}{leaf}: {example}"
    )
    message = f"{path} must be {expected}, got {value!r} ({type(value).__name__})"
    view.issues.append(InputIssue("wrong_type", path, value, message, fix.lstrip("\n")))


def check_value(view: ConfigView, section: str, key: str, value: Any, annotation: Any) -> bool:
    """True when ``value`` fits ``annotation`` as Bridge's merge would take it; else record why."""
    problem = type_problem(value, annotation, dtype_name_problem)
    if problem is not None:
        issue_type(view, f"{section}.{key}", value, problem, annotation)
        return False
    return True


def _fix(section: str, key: str, choices: Iterable[object], value: Any) -> str:
    near = closest(key, choices)
    if near is None:
        return f"# remove {section}.{key}"
    literal = "..." if isinstance(value, (dict, list)) else yaml_literal(value)
    return f"{section}:\n  {near}: {literal}  # was {key}"


def unknown_key(
    section: str, key: str, value: Any, schema: Mapping[str, Any], owner: str, *, fixed: bool, how: str = ""
) -> InputIssue:
    """A key that is not a field of ``owner``: an error when ``owner`` is the class Bridge builds
    (``fixed``), else a warning naming the classes tried and how to make the key checkable."""
    path = f"{section}.{key}"
    if section == PLUGIN_SECTION:
        message = (
            f"{path} is not an option of the plugin{suggest(key, schema)}: the plugin refuses the "
            f"section (options: {', '.join(schema)})"
        )
        return InputIssue("unknown_key", path, value, message, _fix(section, key, schema, value))
    if fixed:
        message = (
            f"{path} is not a field of {owner} in the installed release{suggest(key, schema)}: "
            "Bridge skips it with a log line, and the job runs with the base recipe's value"
        )
        return InputIssue("unknown_key", path, value, message, _fix(section, key, schema, value))
    message = (
        f"{path} is not a field of {owner}{suggest(key, schema)}; the base recipe may build a "
        f"subclass that has it, which check cannot see{how}"
    )
    fix = (
        f"# to check {path}: mxfp8-plugin check FILE --recipe <the base recipe function>, or\n"
        f"{section}:\n  _target_: <the class the job builds>"
    )
    return InputIssue("unknown_key", path, value, message, fix, "warning")


def unknown_section(key: str, sections: Iterable[str]) -> InputIssue:
    """A top-level key that is not a ``ConfigContainer`` section: Bridge ignores it."""
    renamed = RENAMED_SECTIONS.get(key)
    if renamed is not None and renamed in sections:
        why = (
            f"{key} is not a section of Megatron-Bridge's ConfigContainer: sections lost their "
            f"'_config' suffix (model_config -> model, ...); Bridge would ignore it. Rename it to {renamed}"
        )
        return InputIssue("unknown_key", key, "<section>", why, f"# rename section {key}: to {renamed}:")
    near = closest(key, sections)
    fix = f"# rename section {key}: to {near}:" if near else f"# remove {key}"
    why = f"{key} is not a section of Megatron-Bridge's ConfigContainer{suggest(key, sections)}"
    why += "; Bridge would ignore it"
    return InputIssue("unknown_key", key, "<section>", why, fix)
