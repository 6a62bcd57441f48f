"""Finding and reading the installed megatron packages as text, without importing them.

``megatron`` is a namespace package: ``find_spec`` lists its directories and runs no
megatron-core or Bridge code, which is what keeps ``check`` and ``doctor`` off torch.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

__all__ = ["block", "init_signature", "megatron_subdir", "module_file", "read_text", "user_module_file"]


@functools.lru_cache(maxsize=4)
def _roots(path: tuple[str, ...]) -> list[Path]:
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return []
    return [Path(loc) for loc in (spec.submodule_search_locations or [])] if spec else []


def _megatron_roots() -> list[Path]:
    """The ``megatron`` namespace's directories for the current ``sys.path`` (memoized on it:
    one ``check`` asks ~40 times)."""
    return _roots(tuple(sys.path))


def megatron_subdir(sub: str, marker: str) -> Path | None:
    """``megatron/<sub>`` of the first installed copy that holds ``<sub>/<marker>``."""
    for root in _megatron_roots():
        if (root / sub / marker).is_file():
            return root / sub
    return None


def module_file(dotted: str) -> Path | None:
    """The source file of an installed ``megatron.*`` module (a package's ``__init__.py``)."""
    head, *parts = dotted.split(".")
    if head != "megatron" or not parts:
        return None
    for root in _megatron_roots():
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def user_module_file(spec: str) -> Path | None:
    """The source of a user's module, as the launcher's ``module:function`` names it: a file path
    (``recipes/mine.py``) or a dotted module on ``sys.path`` or under the working directory (where
    the launcher is run), found without importing it."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        return path if path.is_file() else None
    parts = spec.split(".")
    for entry in [*sys.path, "."]:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def read_text(root: Path, rel: str) -> str:
    """``root/rel`` as text; empty when absent (an absent file is an absent feature)."""
    f = root / rel
    return f.read_text(encoding="utf-8", errors="replace") if f.is_file() else ""


def block(text: str, kind: str, name: str) -> str:
    """Source of the top-level ``class name`` / ``def name`` up to the next top-level statement
    that opens another ``class``/``def``/decorator; empty when not defined."""
    m = re.search(rf"^{kind} {re.escape(name)}\b", text, re.M)
    if not m:
        return ""
    nxt = re.search(r"^(class |def |@)", text[m.end() :], re.M)
    return text[m.start() : m.end() + nxt.start()] if nxt else text[m.start() :]


def init_signature(class_body: str) -> str:
    """The parameter list of the ``__init__`` inside a class body."""
    m = re.search(r"def __init__\((.*?)\)\s*(->[^:]*)?:", class_body, re.S)
    return m.group(1) if m else ""
