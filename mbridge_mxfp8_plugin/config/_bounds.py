"""Bounds on hostile recipe files, applied before OmegaConf sees the text or resolves a value.

OmegaConf copies every YAML alias into its own node tree, so a 1 kB anchor bomb becomes
gigabytes, and an interpolation chain that fans out (``a: ${b}${b}``, ``b: ${c}${c}``, ...)
doubles the work per line. A recipe is a few kB of knobs, so these bounds cost a real file
nothing: a size cap, strict UTF-8, a count of the nodes aliases expand to (read from the YAML
event stream, never built), and a count of what each interpolation reaches.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from ..errors import MXFP8ConfigError

__all__ = ["MAX_BYTES", "MAX_INTERPOLATION_FANOUT", "MAX_NODES", "RecipeError", "first_line", "read_text"]

#: Largest recipe file read (Bridge's own example overrides are < 4 kB).
MAX_BYTES = 1 << 20
#: Most YAML nodes a recipe may expand to once aliases are copied (the bound on anchor bombs).
MAX_NODES = 200_000
#: Most values one interpolation may reach through other interpolations.
MAX_INTERPOLATION_FANOUT = 10_000


class RecipeError(MXFP8ConfigError):
    """The recipe could not be read at all: one line naming the file (or override) and the cause."""


def fail(path: Path | str, cause: str) -> RecipeError:
    return RecipeError(f"{path}: {cause}")


def first_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's messages run over several lines (full key, object type, ...); the
    first says what is wrong."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_text(path: Path) -> str:
    """The file's text, or one line saying why it is not a recipe file we will read."""
    if not path.exists():
        raise fail(path, "no such recipe file")
    if path.is_dir():
        raise fail(path, "is a directory; give a recipe YAML file")
    if not path.is_file():
        raise fail(path, "is not a regular file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise fail(path, f"is {size} bytes; recipes of at most {MAX_BYTES} bytes are read")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise fail(path, f"cannot read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(path, f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def yaml_error(path: Path, exc: Exception) -> RecipeError:
    """PyYAML's error as one line with its position (its ``str`` spans four)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or first_line(exc)
    context = getattr(exc, "context", None)
    if problem and "duplicate key" in str(exc):
        problem = f"{problem} ({context})" if context else problem
    return fail(path, f"invalid YAML{where}: {problem}")


def prescan(path: Path, text: str) -> None:
    """Count the nodes the document expands to, aliases included, from the event stream alone."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    anchors: dict[str, int] = {}
    stack: list[list[Any]] = [[None, 0]]  # [anchor, nodes] per open collection; root first
    docs = 0
    try:
        for event in yaml.parse(io.StringIO(text), Loader=loader):
            if isinstance(event, yaml.DocumentStartEvent):
                docs += 1
                if docs > 1:
                    raise fail(path, "holds several YAML documents; a recipe is one mapping")
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([event.anchor, 1])
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, count = stack.pop()
                if anchor:
                    anchors[anchor] = count
                stack[-1][1] += count
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor:
                    anchors[event.anchor] = 1
                stack[-1][1] += 1
            elif isinstance(event, yaml.AliasEvent):
                # an alias costs what its anchor holds: this is where a bomb multiplies
                stack[-1][1] += anchors.get(event.anchor or "", 1)
            if stack[0][1] > MAX_NODES or (len(stack) > 1 and stack[-1][1] > MAX_NODES):
                raise fail(
                    path,
                    f"its anchors and aliases expand to more than {MAX_NODES} values (a YAML "
                    "'billion laughs' bomb?); refusing to load it",
                )
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None


_REF = re.compile(r"\$\{([^${}:]+)\}")


def bound_interpolations(source: Path | str, cfg: Any) -> None:
    """Refuse interpolation chains that fan out before OmegaConf resolves them (40 doubling
    lines would never finish)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=False)
    strings: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            dotted = f"{prefix}{k}"
            if isinstance(v, str) and "${" in v:
                strings[dotted] = v
            walk(v, dotted + ".")

    walk(container, "")
    memo: dict[str, int] = {}

    def reach(key: str, depth: int) -> int:
        if key in memo:
            return memo[key]
        if depth > 100:
            raise fail(source, f"interpolations nest more than 100 deep at {key}")
        memo[key] = 1  # a cycle counts once; OmegaConf reports it when resolving
        total = 1 + sum(reach(ref.strip(), depth + 1) for ref in _REF.findall(strings.get(key, "")))
        memo[key] = total
        if total > MAX_INTERPOLATION_FANOUT:
            raise fail(source, f"{key} expands through more than {MAX_INTERPOLATION_FANOUT} interpolations")
        return total

    for key in strings:
        reach(key, 0)
