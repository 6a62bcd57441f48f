"""One installed source file reduced to what a config check asks of it, cached on disk.

Parsing Bridge's ``training/config.py`` and megatron-core's ``transformer_config.py`` with
:mod:`ast` costs ~0.1 s, more than the rest of ``check``. The summary (classes with bases, fields,
enum members, abstractness; imports; ``@register``-ed functions; string keys of dict literals) is
small plain data, stored under ``$XDG_CACHE_HOME/mbridge_mxfp8_plugin`` keyed by the file's path,
size and mtime, so it is rebuilt whenever an upgrade touches the file. It is stored with
:mod:`marshal` (built in: reading it imports nothing, where ``json`` cost ``check`` a few percent
of its floor), so the Python version is part of the key. ``MXFP8_PLUGIN_CACHE=off``
turns the disk cache off; an unwritable cache directory only costs the parse.
"""

from __future__ import annotations

import ast
import functools
import marshal
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["MISSING", "summary"]

#: Bump when the summary's shape changes: older cache files are then ignored.
_FORMAT = 2


class _Missing:
    """No literal default (none given, a factory, or an expression)."""

    def __repr__(self) -> str:
        return "<no literal default>"


MISSING: Any = _Missing()
#: MISSING as stored: marshal keeps a frozenset, and no literal default evaluates to one
_MISSING_MARK = frozenset({"__mxfp8_plugin_missing__"})
_ENUM_BASES = frozenset({"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"})


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return MISSING
    if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] == "field":
        for kw in node.keywords:
            if kw.arg == "default":
                return _default(kw.value)
        return MISSING
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return MISSING
    import json  # building a summary only (a cache miss)

    try:
        json.dumps(value)  # plain data only: what a YAML value can be compared with
    except (TypeError, ValueError):
        return MISSING
    return value


def _base(node: ast.expr) -> str:
    return ast.unparse(node.value if isinstance(node, ast.Subscript) else node)


def _class(node: ast.ClassDef) -> dict[str, Any]:
    bases = [_base(b) for b in node.bases]
    is_enum = any(b.rsplit(".", 1)[-1] in _ENUM_BASES for b in bases)
    fields, members = [], []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            ann = ast.unparse(stmt.annotation)
            if "ClassVar" in ann or "InitVar" in ann:
                continue
            fields.append([stmt.target.id, ann, _default(stmt.value)])
        elif is_enum and isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and not target.id.startswith("_"):
                    value = _default(stmt.value)
                    members.append([target.id, None if value is MISSING else value])
    abstract = any(b.rsplit(".", 1)[-1] == "ABC" for b in bases) or any(
        ast.unparse(d).rsplit(".", 1)[-1] == "abstractmethod"
        for f in node.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in f.decorator_list
    )
    return {"bases": bases, "fields": fields, "enum": members if is_enum else None, "abstract": abstract}


def _package(path: Path) -> list[str]:
    """The dotted package of ``path`` inside the ``megatron`` namespace (for relative imports)."""
    parts = list(path.with_suffix("").parts)
    if "megatron" not in parts:
        return []
    at = len(parts) - 1 - parts[::-1].index("megatron")
    return parts[at:-1]


def _imports(path: Path, tree: ast.Module) -> dict[str, list[Any]]:
    """alias -> [module, name] (``from module import name``) or [module, None] (``import module``)."""
    out: dict[str, list[Any]] = {}
    package = _package(path)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = [module, alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = [alias.name, None]
                else:
                    head = alias.name.split(".")[0]
                    out.setdefault(head, [head, None])
    return out


def _build(path: Path) -> dict[str, Any] | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    classes: dict[str, Any] = {}
    registered: list[str] = []
    dict_keys: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = _class(node)
        elif isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] == "register" for d in node.decorator_list
        ):
            registered.append(node.name)
    for sub in ast.walk(tree):
        target = getattr(sub, "target", None) or (getattr(sub, "targets", None) or [None])[0]
        value = getattr(sub, "value", None)
        if isinstance(sub, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name):
            if isinstance(value, ast.Dict):
                keys = [
                    k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                ]
                dict_keys[target.id] = keys
    return {
        "classes": classes,
        "imports": _imports(path, tree),
        "registered": registered,
        "dict_keys": dict_keys,
    }


def _cache_dir() -> Path | None:
    if os.environ.get("MXFP8_PLUGIN_CACHE", "").lower() in ("off", "0", "no", "false"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbridge_mxfp8_plugin"


def _encode(data: dict[str, Any]) -> bytes:
    """``data`` as marshal bytes, MISSING (which marshal cannot store) as its stored mark. Field
    defaults are the only place it can be: fields are ``[name, annotation, default]``."""
    summary = data["summary"]
    classes = {
        name: {**c, "fields": [[n, a, _MISSING_MARK if d is MISSING else d] for n, a, d in c["fields"]]}
        for name, c in summary["classes"].items()
    }
    return marshal.dumps({**data, "summary": {**summary, "classes": classes}})


def _decode(raw: bytes) -> dict[str, Any]:
    """What :func:`_encode` stored, the mark swapped back in place: marshal made every list anew,
    and a copy of each summary would cost ``check`` a few percent of its floor."""
    stored: dict[str, Any] = marshal.loads(raw)
    for c in stored["summary"]["classes"].values():
        for f in c["fields"]:
            if type(f[2]) is frozenset and f[2] == _MISSING_MARK:
                f[2] = MISSING
    return stored


def _fnv1a(text: str) -> int:
    """A stable 32-bit hash of a path (``hash()`` changes per process; zlib is an import more)."""
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


@functools.cache
def summary(path: Path) -> dict[str, Any] | None:
    """The summary of one source file (None when it cannot be read or parsed)."""
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = {
        "v": (_FORMAT, marshal.version, sys.version_info[:2]),
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    cache = _cache_dir()
    key = f"{path.stem}-{_fnv1a(str(path)):08x}"  # the stamp inside guards collisions
    if cache is not None:
        try:
            stored = _decode((cache / f"{key}.marshal").read_bytes())
            if {k: stored.get(k) for k in stamp} == stamp:
                return stored["summary"]  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    built = _build(path)
    if built is not None and cache is not None:
        import tempfile  # only when writing: it pulls in random and shutil

        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_encode({**stamp, "summary": built}))
            os.replace(tmp, cache / f"{key}.marshal")
        except (OSError, ValueError):  # ValueError: a value marshal cannot store
            pass
    return built
