"""What the *installed* megatron-core and Megatron-Bridge accept, read from their source files.

Parsed with :mod:`ast`, never imported or executed (importing them costs seconds, Bridge needs
Transformer Engine): megatron-core's ``DistributedDataParallelConfig`` / ``OptimizerConfig``
fields and defaults (Bridge merges YAML into those classes, so the installed release decides
which ``ddp.*`` / ``optimizer.*`` keys exist), the fields of every other ``ConfigContainer``
section (:func:`section_fields`), Bridge's mixed-precision registry (``@register``),
``MixedPrecisionConfig``'s defaults and the dtype names its override merge converts.
"""

from __future__ import annotations

import ast
import functools
import re
import typing
from pathlib import Path
from typing import Any, NamedTuple

from .._yamltypes import DTYPE, type_problem
from ..probes import module_file
from ..probes.bridge import bridge_training_dir
from ..probes.core import core_package_dir
from ..probes.versions import installed_version
from .schema import BRIDGE_DDP_EXTRA

__all__ = [
    "BridgeFacts",
    "SectionFields",
    "bridge_facts",
    "container_sections",
    "core_default",
    "core_fields",
    "dtype_name_problem",
    "section_fields",
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
        return DTYPE if node.attr == "dtype" else Any
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
    if DTYPE in members:
        return DTYPE
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


@functools.cache
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError):
        return None


def _imported_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute dotted name an ``from X import ...`` in ``path`` refers to."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(_package_root(path)).with_suffix("").parts)[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(["megatron", *base, *([node.module] if node.module else [])])


def _package_root(path: Path) -> Path:
    """The directory holding the ``megatron`` namespace package that contains ``path``."""
    for parent in path.parents:
        if parent.name == "megatron":
            return parent
    return path.parent


def _find_class(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """Where class ``name`` as seen from module ``path`` is defined (following imports)."""
    tree = _tree(path)
    if tree is None or depth > 8:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    target = module_file(_imported_module(path, node))
                    return _find_class(target, alias.name, depth + 1) if target else None
    return None


#: Bases that add no dataclass fields.
_PLAIN_BASES = frozenset({"ABC", "Generic", "Protocol", "object", "Enum", "str"})


def _base_name(node: ast.expr) -> str:
    node = node.value if isinstance(node, ast.Subscript) else node
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _fields_of(path: Path, cls: ast.ClassDef, depth: int = 0) -> dict[str, tuple[Any, Any]] | None:
    """``field -> (annotation, default)`` of a dataclass and its bases; None if a base is not
    readable (then the field list is incomplete and no key may be called unknown)."""
    out: dict[str, tuple[Any, Any]] = {}
    for base in cls.bases:
        name = _base_name(base)
        if name in _PLAIN_BASES:
            continue
        found = _find_class(path, name)
        inherited = _fields_of(*found, depth + 1) if found and depth < 16 else None
        if inherited is None:
            return None
        out.update(inherited)
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.dump(stmt.annotation) or "InitVar" in ast.dump(stmt.annotation):
                continue
            ann, default = _annotation(stmt.annotation), _default(stmt.value)
            if default is None and ann is not Any and ann is not DTYPE and type_problem(None, ann):
                ann = _union([ann, type(None)])  # e.g. ``suggested_communication_unit_size: int = None``
            out[stmt.target.id] = (ann, default)
    return out


def _class_fields(path: Path, name: str) -> dict[str, tuple[Any, Any]] | None:
    found = _find_class(path, name)
    return _fields_of(*found) if found else None


_CORE_CLASSES = {
    "ddp": ("distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig"),
    "optimizer": ("optimizer/optimizer_config.py", "OptimizerConfig"),
}


@functools.lru_cache(maxsize=8)
def _core_class(section: str) -> dict[str, tuple[Any, Any]] | None:
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


class SectionFields(NamedTuple):
    """The keys one ``ConfigContainer`` section accepts in the installed Megatron-Bridge."""

    #: The class (or classes) the section is built as, for messages.
    owner: str
    #: The accepted keys; ``None`` when they cannot be known from the files (see ``why``).
    fields: frozenset[str] | None
    why: str = ""


def _config_py() -> Path | None:
    root = bridge_training_dir()
    return root / "config.py" if root and (root / "config.py").is_file() else None


@functools.lru_cache(maxsize=1)
def container_sections() -> dict[str, ast.expr] | None:
    """``ConfigContainer`` field -> its annotation, from the installed Bridge; None without Bridge."""
    path = _config_py()
    found = _find_class(path, "ConfigContainer") if path else None
    if found is None:
        return None
    return {
        stmt.target.id: stmt.annotation
        for stmt in found[1].body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def _is_open(cls: ast.ClassDef) -> bool:
    """An abstract class: the keys a recipe may give depend on the subclass the base recipe builds."""
    abstract = any(
        _base_name(d) == "abstractmethod"
        for f in cls.body
        if isinstance(f, ast.FunctionDef)
        for d in f.decorator_list
    )
    return abstract or any(_base_name(b) == "ABC" for b in cls.bases)


#: A field declared in a class body (4-space indent), for the model providers' subclasses.
_CLASS_FIELD = re.compile(r"^    ([A-Za-z_]\w*)\s*:", re.M)


@functools.lru_cache(maxsize=1)
def _provider_subclass_fields() -> frozenset[str]:
    """Every field any class under ``megatron/bridge/models`` declares: a base recipe builds a
    model family's provider subclass (``Llama3ModelProvider``...), whose extra fields are valid."""
    root = bridge_training_dir()
    models = root.parent / "models" if root else None
    if models is None or not models.is_dir():
        return frozenset()
    out: set[str] = set()
    for f in models.rglob("*.py"):
        out.update(_CLASS_FIELD.findall(f.read_text(encoding="utf-8", errors="replace")))
    return frozenset(out)


def _classes_in(annotation: ast.expr) -> list[str]:
    nodes = [n for n in ast.walk(annotation) if isinstance(n, (ast.Name, ast.Attribute))]
    names = [_base_name(n) for n in sorted(nodes, key=lambda n: n.col_offset)]
    return [n for n in names if n and n not in ("Optional", "Union", "str", "None")]


@functools.lru_cache(maxsize=64)
def section_fields(section: str, target: str | None = None) -> SectionFields:
    """The keys ``section`` accepts: those of its ``_target_`` class when given, else of the
    class(es) ``ConfigContainer`` declares for it (a model provider's subclasses included)."""
    path = _config_py()
    if path is None:
        return SectionFields(section, None, "Megatron-Bridge is not installed here")
    if target:
        module, _, name = target.rpartition(".")
        where = module_file(module)
        fields = _class_fields(where, name) if where else None
        if fields is None:
            return SectionFields(target, None, f"_target_ {target} is not a class in the installed files")
        return SectionFields(name, frozenset(fields))
    annotation = (container_sections() or {}).get(section)
    if annotation is None:
        return SectionFields(section, None, "not a ConfigContainer field")
    names = _classes_in(annotation)
    out: set[str] = set()
    for name in names:
        found = _find_class(path, name)
        if found is None:
            return SectionFields(name, None, f"{name} is not readable from the installed files")
        if _is_open(found[1]):
            return SectionFields(
                name,
                None,
                f"{name} is abstract: its keys depend on the subclass the "
                "base recipe builds (give the section a _target_ to check them)",
            )
        fields = _fields_of(*found)
        if fields is None:
            return SectionFields(name, None, f"a base class of {name} is not readable from the files")
        out.update(fields)
    owner = " | ".join(names)
    if section == "model":
        out |= _provider_subclass_fields()
        owner += " (or a provider subclass in megatron/bridge/models)"
    return SectionFields(owner, frozenset(out))
