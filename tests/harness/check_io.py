"""``check`` run in this process, as the unit tests of the config column and of its rules call it.

:func:`run` returns ``(exit status, stdout, stderr)`` of
:func:`~mbridge_mxfp8_plugin.commands.check.run_check` on the defective release pair of
:mod:`.mx_cases` unless ``installed`` says otherwise; :func:`run_json` and :func:`rule` read its
``--json`` report. The data files are ``tests/data`` (:data:`DATA`) and
``tests/data/check_exact`` (:data:`EXACT`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from mbridge_mxfp8_plugin.commands.check import run_check
from mbridge_mxfp8_plugin.probes.fields import container_sections

from .mx_cases import DEFECTIVE, ROOT, TINY

__all__ = [
    "DATA",
    "EXACT",
    "findings",
    "lines",
    "needs_bridge",
    "rule",
    "run",
    "run_json",
    "status",
    "without_plugin_section",
]

DATA = ROOT / "tests" / "data"
EXACT = DATA / "check_exact"
needs_bridge = pytest.mark.skipif(container_sections() is None, reason="no Megatron-Bridge installed to read")


def run(recipe: Any, overrides: Any = (), **kw: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("installed", DEFECTIVE)
    code = run_check(str(recipe), list(overrides), out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def run_json(recipe: Any, overrides: Any = (), **kw: Any) -> tuple[int, dict[str, Any]]:
    code, out, _ = run(recipe, overrides, as_json=True, **kw)
    return code, json.loads(out)


def rule(recipe: Any, rule: str, overrides: Any = (), **kw: Any) -> tuple[int, dict[str, Any]]:
    code, out, _ = run(recipe, overrides, as_json=True, **kw)
    (result,) = [r for r in json.loads(out)["rules"] if r["id"] == rule]
    return code, result


def status(report: dict[str, Any]) -> dict[str, str]:
    return {r["id"]: r["status"] for r in report["rules"]}


def findings(report: Any, rule: str) -> list[Any]:
    """The findings of one rule in a :func:`~mbridge_mxfp8_plugin.validate_config` report."""
    return [f for f in report.findings if f.rule == rule]


def lines(out: str, prefix: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(prefix)]


def without_plugin_section(tmp_path: Path) -> Path:
    """The shipped tiny recipe without its ``mxfp8_plugin:`` section."""
    path = tmp_path / "no_plugin.yaml"
    path.write_text(TINY.read_text().split("mxfp8_plugin:")[0])
    return path
