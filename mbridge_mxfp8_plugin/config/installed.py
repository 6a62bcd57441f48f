"""What the *installed* megatron-core and Megatron-Bridge accept, read from their source files.

Parsed with :mod:`ast`, never imported or executed (importing them costs seconds, Bridge needs
Transformer Engine): megatron-core's ``DistributedDataParallelConfig`` / ``OptimizerConfig``
fields and defaults (Bridge merges YAML into those classes, so the installed release decides
which ``ddp.*`` / ``optimizer.*`` keys exist), Bridge's mixed-precision registry (``@register``),
``MixedPrecisionConfig``'s defaults and the dtype names its override merge converts.
"""

from __future__ import annotations

import ast
import functools
import typing
from pathlib import Path
from typing import Any

from .schema import BRIDGE_DDP_EXTRA, type_problem

__all__ = [
    "BridgeFacts",
    "bridge_facts",
    "core_default",
    "core_defaults",
    "core_fields",
    "dtype_name_problem",
]

#: ``torch`` attributes that are dtypes: what Bridge 0.3 accepts for a dtype field
#: (``getattr(torch, value.split(".")[-1])``), listed so that no torch import is needed.
TORCH_DTYPE_NAMES = frozenset(
    {
        "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64", "cfloat",
        "complex128", "cdouble", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long",
        "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16",
        "uint32", "uint64", "float8_e8m0fnu",
    }
)  # fmt: skip

_MISSING: Any = object()


def _annotation(node: ast.expr | None) -> Any:
    """A source annotation as a typing object that :func:`type_problem` can judge (Any if not)."""
    if node is None:
        return Any
    if isinstance(node, ast.Constant):
        if node.value is None:
            return type(None)
        if isinstance(node.value, str):  # a string annotation
            try:
                return _annotation(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return Any
        return Any
    if isinstance(node, ast.Name):
        simple = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "dict": dict}
        simple.update({"List": list, "Tuple": tuple, "tuple": tuple, "Dict": dict})
        return simple.get(node.id, Any)
    if isinstance(node, ast.Attribute):
        return "dtype?" if node.attr == "dtype" else Any
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_annotation(node.left), _annotation(node.right)])
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Optional":
            return _union([_annotation(args[0]), type(None)])
        if base == "Union":
            return _union([_annotation(a) for a in args])
        if base == "Literal":
            values = [a.value for a in args if isinstance(a, ast.Constant)]
            return typing.Literal[tuple(values)] if values else Any
        if base in ("List", "list", "Tuple", "tuple", "Sequence"):
            return list
        if base in ("Dict", "dict", "Mapping"):
            return dict
    return Any


def _union(members: list[Any]) -> Any:
    if any(m is Any for m in members):
        return Any
    if "dtype?" in members:
        return "dtype?"
    out: Any = members[0]
    for m in members[1:]:
        out = typing.Union[out, m]  # noqa: UP007 - members may be typing objects
    return out


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return _MISSING
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        for kw in node.keywords:
            if kw.arg == "default":
                return _default(kw.value)
        return _MISSING
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _MISSING


def _class_fields(path: Path, name: str) -> dict[str, tuple[Any, Any]] | None:
    """``field -> (annotation, default)`` of a dataclass in a source file (bases in the same file)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError):
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        return None
    out: dict[str, tuple[Any, Any]] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(_class_fields(path, base.id) or {})
    for stmt in classes[name].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.dump(stmt.annotation) or "InitVar" in ast.dump(stmt.annotation):
                continue
            ann, default = _annotation(stmt.annotation), _default(stmt.value)
            if default is None and ann is not Any and ann != "dtype?" and type_problem(None, ann):
                ann = _union([ann, type(None)])  # e.g. ``suggested_communication_unit_size: int = None``
            out[stmt.target.id] = (ann, default)
    return out


_CORE_CLASSES = {
    "ddp": ("distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig"),
    "optimizer": ("optimizer/optimizer_config.py", "OptimizerConfig"),
}


@functools.lru_cache(maxsize=8)
def _core_class(section: str) -> dict[str, tuple[Any, Any]] | None:
    from ..probes.core import core_package_dir

    root = core_package_dir()
    if root is None or section not in _CORE_CLASSES:
        return None
    rel, name = _CORE_CLASSES[section]
    return _class_fields(root / rel, name)


def core_fields(section: str) -> dict[str, Any] | None:
    """Field -> annotation of the installed megatron-core class behind ``ddp`` / ``optimizer``.

    Read from the installed source file, not imported. ``None`` when megatron-core is not
    installed (then keys are not checked, only the types of the knobs the rules read).
    """
    fields = _core_class(section)
    if fields is None:
        return None
    out = {k: ann for k, (ann, _) in fields.items()}
    if section == "ddp":
        out.update(BRIDGE_DDP_EXTRA)
    return out


def core_default(section: str, knob: str) -> Any:
    """megatron-core's default for a knob (what an unset field of a fresh config holds); None if unknown."""
    default = (_core_class(section) or {}).get(knob, (None, None))[1]
    return None if default is _MISSING else default


def core_defaults(section: str) -> dict[str, Any]:
    """Every field of the installed class that has a literal default (what a fresh instance holds)."""
    return {k: d for k, (_, d) in (_core_class(section) or {}).items() if d is not _MISSING}


class BridgeFacts(typing.NamedTuple):
    """What the installed Megatron-Bridge converts, read from its files."""

    version: str | None
    #: Names registered with ``@register`` in ``training/mixed_precision.py``.
    recipe_names: frozenset[str]
    #: Strings its override merge turns into a torch dtype.
    dtype_names: frozenset[str]
    #: ``MixedPrecisionConfig`` field defaults (what a ``_target_`` instance holds when unstated).
    mp_defaults: dict[str, Any]


@functools.lru_cache(maxsize=1)
def bridge_facts() -> BridgeFacts | None:
    """The installed Bridge's registry and conversions, or None when Bridge is not installed."""
    from ..probes.bridge import bridge_training_dir
    from ..probes.versions import installed_version

    root = bridge_training_dir()
    if root is None:
        return None
    version = installed_version("megatron-bridge")
    names: set[str] = set()
    mp_file = root / "mixed_precision.py"
    try:
        tree = ast.parse(mp_file.read_text(encoding="utf-8", errors="replace"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                getattr(d, "id", None) == "register" for d in node.decorator_list
            ):
                names.add(node.name)
    except (OSError, SyntaxError):
        pass
    mp_defaults = {k: d for k, (_, d) in (_class_fields(mp_file, "MixedPrecisionConfig") or {}).items()}
    mp_defaults = {k: d for k, d in mp_defaults.items() if d is not _MISSING}
    dtypes = _bridge_dtype_names(root.parent / "utils" / "activation_map.py")
    return BridgeFacts(version, frozenset(names), dtypes, mp_defaults)


def _bridge_dtype_names(activation_map: Path) -> frozenset[str]:
    """Bridge >= 0.4 converts through ``str_to_dtype`` (its ``DTYPE_MAP`` plus ``torch.`` aliases);
    earlier releases through ``getattr(torch, name.split('.')[-1])``."""
    try:
        tree = ast.parse(activation_map.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError):
        return frozenset(TORCH_DTYPE_NAMES | {f"torch.{n}" for n in TORCH_DTYPE_NAMES})
    keys: set[str] = set()
    for node in ast.walk(tree):
        target = getattr(node, "target", None)
        if isinstance(node, ast.AnnAssign) and getattr(target, "id", "") == "DTYPE_MAP":
            if isinstance(node.value, ast.Dict):
                consts = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
                keys |= {k for k in consts if isinstance(k, str)}
    aliases = {f"torch.{k}" for k in keys if "." not in k and not k[0].isdigit() and "-" not in k}
    return frozenset(keys | aliases)


def dtype_name_problem(value: Any) -> str | None:
    """None when the installed Bridge turns ``value`` into a torch dtype (or it is null / a dtype)."""
    if value is None or type(value).__name__ == "dtype":
        return None
    facts = bridge_facts()
    if facts is None:  # no Bridge: which names it converts is unknown (the report says so)
        return None
    names = facts.dtype_names
    if isinstance(value, str) and value in names:
        return None
    shown = ", ".join(sorted(n for n in names if "." not in n)[:8])
    who = f"Megatron-Bridge {facts.version}" if facts and facts.version else "Megatron-Bridge"
    return f"a dtype name {who} converts ({shown}, ...) or null"
