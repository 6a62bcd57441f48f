"""What a config check found, and how it is shown: the report model, the table, JSON.

Rules (:mod:`.rules`) produce :class:`RuleResult` objects; nothing here knows a knob. Values are
rendered as the user writes them in YAML (``true``, ``null``), so a fix can be pasted back.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

import yaml

from ..common.records import record
from ..common.yamltypes import plain_data, yaml_literal
from ..errors import MXFP8ConfigError
from .view import UNKNOWN

__all__ = ["ConfigValidationError", "Finding", "Rule", "RuleResult", "ValidationReport"]

Severity = Literal["error", "warning"]
Status = Literal["pass", "warn", "fail", "n/a"]


@record
class Rule:
    id: str
    title: str


@record
class Finding:
    """One violation: where (``knob``), what was seen (``value``), why (``message``), and the fix."""

    rule: str
    severity: Severity
    knob: str
    value: Any
    message: str
    fix: Any = None

    @property
    def fix_yaml(self) -> str:
        if self.fix is None:
            return ""
        if isinstance(self.fix, str):
            return self.fix
        return yaml.safe_dump(self.fix, default_flow_style=False, sort_keys=False).rstrip()

    def line(self) -> str:
        return f"{self.severity} {self.rule} {self.knob}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "knob": self.knob,
            "value": _jsonable(self.value),
            "message": self.message,
            "fix": self.fix_yaml,
        }


@record(frozen=False)
class RuleResult:
    rule: Rule
    status: Status
    findings: list[Finding] = field(default_factory=list)
    #: For pass / n/a: what was checked, or why the rule could not be evaluated.
    note: str = ""
    #: The knob the rule is about and the value seen (for the table even when it passes).
    knob: str = ""
    value: Any = UNKNOWN


@record(frozen=False)
class ValidationReport:
    """Every rule's verdict. ``ok`` is False when any rule failed (errors, not warnings)."""

    kind: str
    results: list[RuleResult]
    dp_size: int | None = None
    installed: str = ""
    #: checks that could not run here, and why
    skipped: list[str] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def by_rule(self, rule_id: str) -> RuleResult:
        for r in self.results:
            if r.rule.id == rule_id:
                return r
        raise KeyError(rule_id)

    def format_errors(self) -> str:
        lines = [f"MXFP8 config check failed with {len(self.errors)} error(s):"]
        for f in self.errors:
            lines.append(f"  {f.line()}")
            if f.fix_yaml:
                lines.append("    fix:\n" + _indent(f.fix_yaml, 6))
        return "\n".join(lines)

    def format_table(self) -> str:
        """One row per rule (pass / warn / fail / n/a), then each finding with its YAML fix."""
        rows = [("RULE", "STATUS", "CHECK", "KNOB", "VALUE", "NOTE")]
        for r in self.results:
            knob = r.findings[0].knob if r.findings else r.knob
            value = r.findings[0].value if r.findings else r.value
            note = f"{len(r.findings)} finding(s) below" if r.findings else r.note
            status = r.status.upper() if r.status in ("fail", "warn") else r.status
            rows.append((r.rule.id, status, r.rule.title, _clip(knob or "-", 48), _short(value), note))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        out = [
            "  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
            for row in rows
        ]
        for r in self.results:
            for f in r.findings:
                out.append("")
                out.append(f.line())
                if f.fix_yaml:
                    out.append("  fix:\n" + _indent(f.fix_yaml, 4))
        out.append("")
        out.append(
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
            f"{'' if self.dp_size is None else f'; dp_size={self.dp_size}'}; {self.installed}"
        )
        out.extend(f"not checked: {note}" for note in self.skipped)
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "kind": self.kind,
            "dp_size": self.dp_size,
            "installed": self.installed,
            "skipped": list(self.skipped),
            "rules": [
                {
                    "id": r.rule.id,
                    "title": r.rule.title,
                    "status": r.status,
                    "knob": r.knob,
                    "value": _jsonable(r.value),
                    "note": r.note,
                    "findings": [f.as_dict() for f in r.findings],
                }
                for r in self.results
            ],
        }


class ConfigValidationError(MXFP8ConfigError):
    """Raised by strict validation; ``.report`` holds every rule's verdict."""

    def __init__(self, report: ValidationReport) -> None:
        super().__init__(report.format_errors())
        self.report = report


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(value: Any) -> str:
    if value is UNKNOWN:
        return "-"
    return _clip(yaml_literal(value), 30)


def _jsonable(value: Any) -> Any:
    return None if value is UNKNOWN else plain_data(value)
