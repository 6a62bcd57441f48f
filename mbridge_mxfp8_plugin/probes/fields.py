"""The fields of the installed megatron-core and Megatron-Bridge config classes, read from source.

Parsed with :mod:`ast`, never imported (importing them costs seconds, and Bridge needs
Transformer Engine): which keys a section accepts and what type each holds is what the installed
release says, so a key added or retyped upstream is judged right without a plugin release.
A file is reduced once to a small summary (:mod:`._summary`: classes, bases, fields with their
annotation source and literal default, enum members, imports), kept on disk keyed by the file's
path, size and mtime, because parsing Bridge's ``config.py`` and megatron-core's
``TransformerConfig`` costs more than the rest of ``check`` together.
"""

from __future__ import annotations

import ast
import functools
import typing
from pathlib import Path
from typing import Any, NamedTuple

from ..common.yamltypes import DTYPE, EnumType, type_problem
from ._source import module_file
from ._summary import MISSING, summary
from .core import core_package_dir
from .loops import bridge_training_dir

__all__ = [
    "MISSING",
    "SectionFields",
    "class_fields",
    "config_py",
    "container_sections",
    "core_default",
    "core_fields",
    "find_class",
    "section_fields",
    "value_domain",
]

#: typing names whose value a YAML knob can hold as a plain list / mapping.
_SEQUENCES = frozenset({"List", "list", "Tuple", "tuple", "Sequence", "Set", "set", "FrozenSet", "frozenset"})
_MAPPINGS = frozenset({"Dict", "dict", "Mapping", "MutableMapping", "OrderedDict"})
_SIMPLE = {"bool": bool, "int": int, "float": float, "str": str}
#: Bases that add no dataclass fields.
_PLAIN_BASES = frozenset({"ABC", "Generic", "Protocol", "object", "Enum", "str", "int", "IntEnum", "StrEnum"})


class Field:
    """One dataclass field: its literal default (:data:`MISSING` when none or not a literal) and
    its annotation as something :func:`type_problem` can judge (Any when it cannot).

    The annotation is converted on first use: a section is checked for the few keys a file
    writes, not for the hundreds of fields ``TransformerConfig`` declares.
    """

    __slots__ = ("_ann", "_path", "_src", "default")

    def __init__(self, path: Path, src: str, default: Any) -> None:
        self._path, self._src, self.default = path, src, default
        self._ann: Any = MISSING

    @property
    def annotation(self) -> Any:
        if self._ann is MISSING:
            self._ann = _convert(self._path, self._src, self.default is None)
        return self._ann


class LazyFields(dict):  # type: ignore[type-arg]
    """``field -> annotation``, each converted from source on first lookup."""

    def __init__(self, fields: dict[str, Field]) -> None:
        super().__init__(fields)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key).annotation

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[key] if key in self else default

    def items(self) -> Any:  # type: ignore[override]
        return ((k, self[k]) for k in self)

    def values(self) -> Any:  # type: ignore[override]
        return (self[k] for k in self)


@functools.lru_cache(maxsize=1024)
def _convert(path: Path, src: str, default_none: bool) -> Any:
    try:
        node: ast.expr | None = ast.parse(src, mode="eval").body
    except SyntaxError:
        node = None
    ann = _SIMPLE.get(src) or _annotation(path, node)
    if default_none and ann is not Any and ann is not DTYPE and type_problem(None, ann):
        ann = _union([ann, type(None)])  # ``suggested_communication_unit_size: int = None``
    return ann


def find_class(path: Path, name: str, depth: int = 0) -> tuple[Path, dict[str, Any]] | None:
    """Where class ``name``, as module ``path`` sees it, is defined (imports followed)."""
    info = summary(path)
    if info is None or depth > 8:
        return None
    head, _, rest = name.partition(".")
    if rest:  # ``enums.AttnBackend`` after ``from megatron.core import enums``
        imported = info["imports"].get(head)
        if imported is None:
            return None
        target = module_file(".".join(p for p in imported if p))
        return find_class(target, rest, depth + 1) if target else None
    if name in info["classes"]:
        return path, info["classes"][name]
    imported = info["imports"].get(name)
    if imported is None or imported[1] is None:
        return None
    target = module_file(imported[0])
    return find_class(target, imported[1], depth + 1) if target else None


def _annotation(path: Path, node: ast.expr | None) -> Any:
    """A source annotation as a typing object :func:`type_problem` can judge (Any when it cannot)."""
    if node is None:
        return Any
    if isinstance(node, ast.Constant):
        if node.value is None:
            return type(None)
        if isinstance(node.value, str):  # a string annotation
            try:
                return _annotation(path, ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return Any
        return Any
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_annotation(path, node.left), _annotation(path, node.right)])
    if isinstance(node, ast.Subscript):
        return _generic(path, node)
    if isinstance(node, (ast.Name, ast.Attribute)):
        dotted = ast.unparse(node)
        if dotted in _SIMPLE:
            return _SIMPLE[dotted]
        if dotted.endswith("dtype") and dotted.split(".")[0] in ("torch", "dtype"):
            return DTYPE
        if dotted in _SEQUENCES:
            return list
        if dotted in _MAPPINGS:
            return dict
        return _enum_or_any(path, dotted)
    return Any


def _generic(path: Path, node: ast.Subscript) -> Any:
    base = ast.unparse(node.value).rsplit(".", 1)[-1]
    args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    if base == "Optional":
        return _union([_annotation(path, args[0]), type(None)])
    if base == "Union":
        return _union([_annotation(path, a) for a in args])
    if base == "Literal":
        values = [a.value for a in args if isinstance(a, ast.Constant)]
        return typing.Literal[tuple(values)] if len(values) == len(args) and values else Any
    if base in _SEQUENCES:
        return list
    if base in _MAPPINGS:
        return dict
    return Any  # Callable[...], Annotated[...], ClassVar: not judged


def _enum_or_any(path: Path, dotted: str) -> Any:
    """An enum class named in an annotation, as :class:`EnumType`; any other class is Any (a
    nested config or an object a YAML knob cannot hold)."""
    found = find_class(path, dotted)
    if found is None or found[1]["enum"] is None:
        return Any
    members = found[1]["enum"]
    return EnumType(dotted.rsplit(".", 1)[-1], tuple(m for m, _ in members), tuple(v for _, v in members))


def _union(members: list[Any]) -> Any:
    if any(m is Any for m in members):
        return Any
    if DTYPE in members:
        return DTYPE
    out: Any = members[0]
    for m in members[1:]:
        out = typing.Union[out, m]  # noqa: UP007 - members may be typing objects
    return out


@functools.lru_cache(maxsize=256)
def _fields_of(path: Path, name: str, depth: int = 0) -> dict[str, Field] | None:
    """``field -> Field`` of dataclass ``name`` (as ``path`` sees it) and its bases; None if a
    base is not readable (then the list is incomplete, and no key may be called unknown)."""
    found = find_class(path, name)
    if found is None or depth > 16:
        return None
    where, info = found
    out: dict[str, Field] = {}
    for base in info["bases"]:
        if base.rsplit(".", 1)[-1] in _PLAIN_BASES:
            continue
        inherited = _fields_of(where, base, depth + 1)
        if inherited is None:
            return None
        out.update(inherited)
    for fname, ann_src, default in info["fields"]:
        out[fname] = Field(where, ann_src, default)
    return out


def class_fields(module: str | Path, name: str) -> dict[str, Field] | None:
    """The fields of class ``name`` in an installed module (dotted name or file), or None."""
    path = module if isinstance(module, Path) else module_file(module)
    return _fields_of(path, name) if path is not None else None


def is_open(info: dict[str, Any]) -> bool:
    """An abstract class: which keys a recipe may give depends on the subclass the base recipe builds."""
    return bool(info["abstract"])


_CORE_CLASSES = {
    "ddp": ("distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig"),
    "optimizer": ("optimizer/optimizer_config.py", "OptimizerConfig"),
}


def _core_class(section: str) -> dict[str, Field] | None:
    root = core_package_dir()
    if root is None or section not in _CORE_CLASSES:
        return None
    rel, name = _CORE_CLASSES[section]
    return _fields_of(root / rel, name)


def core_fields(section: str) -> dict[str, Any] | None:
    """Field -> annotation of the class Bridge builds ``ddp`` / ``optimizer`` as.

    Bridge's own subclass when Bridge is installed (it adds fields), else megatron-core's;
    ``None`` when neither is installed (then keys are not checked, only the knobs the rules read).
    """
    bridge = section_fields(section)
    if bridge.fields is not None:
        return bridge.fields
    fields = _core_class(section)
    return None if fields is None else LazyFields(fields)


def core_default(section: str, knob: str) -> Any:
    """megatron-core's default for a knob (what an unset field of a fresh config holds); None if unknown."""
    field = (_core_class(section) or {}).get(knob)
    return None if field is None or field.default is MISSING else field.default


#: String knobs whose legal values are a megatron-core enum's members: releases before 0.16
#: annotate them as a plain ``str`` (0.16 as a Literal), and compare the string with the enum.
_STRING_ENUMS = {
    "fp8_recipe": ("megatron.core.enums", "Fp8Recipe"),
    "fp4_recipe": ("megatron.core.enums", "Fp4Recipe"),
}


@functools.lru_cache(maxsize=8)
def value_domain(knob: str) -> EnumType | None:
    """The enum a string knob's value must name in the installed megatron-core, or None."""
    where = _STRING_ENUMS.get(knob)
    path = module_file(where[0]) if where else None
    if where is None or path is None:
        return None
    found = find_class(path, where[1])
    if found is None or found[1]["enum"] is None:
        return None
    members = found[1]["enum"]
    return EnumType(where[1], tuple(m for m, _ in members), tuple(v for _, v in members))


def config_py() -> Path | None:
    """Bridge's ``training/config.py`` (where ``ConfigContainer`` and its section classes live)."""
    root = bridge_training_dir()
    return root / "config.py" if root and (root / "config.py").is_file() else None


@functools.lru_cache(maxsize=1)
def container_sections() -> dict[str, str] | None:
    """``ConfigContainer`` field -> its annotation's source, from the installed Bridge; None without it."""
    path = config_py()
    found = find_class(path, "ConfigContainer") if path else None
    if found is None:
        return None
    return {name: ann for name, ann, _ in found[1]["fields"]}


class SectionFields(NamedTuple):
    """What one ``ConfigContainer`` section accepts in the installed Megatron-Bridge."""

    #: The class (or classes) the section may be built as, for messages.
    owner: str
    #: field -> annotation; ``None`` when not readable from the files (see ``why``).
    fields: dict[str, Any] | None
    #: True when the class is known (a ``_target_``, a recipe, or the section's one concrete
    #: class): a key that is not a field is then an error; otherwise a subclass the base recipe
    #: builds may have it, and it is only a warning.
    fixed: bool = False
    why: str = ""
    #: a plain mapping (``env_vars: dict[str, ...]``): any key is accepted
    free: bool = False


def _classes_in(annotation: str) -> list[str]:
    """Class names in a ``ConfigContainer`` annotation, in order (``Optional``/``None``/``str`` dropped)."""
    try:
        tree: ast.expr = ast.parse(annotation, mode="eval").body
    except SyntaxError:
        return []

    def names(node: ast.expr) -> list[str]:
        if isinstance(node, (ast.Name, ast.Attribute)):
            return [ast.unparse(node)]
        if isinstance(node, ast.BinOp):
            return names(node.left) + names(node.right)
        if isinstance(node, ast.Tuple):
            return [n for e in node.elts for n in names(e)]
        if isinstance(node, ast.Subscript):  # Optional[X], Union[X, Y]
            return names(node.slice)
        return []

    return [n for n in dict.fromkeys(names(tree)) if n.rsplit(".", 1)[-1] not in ("str", "None")]


def target_fields(target: str) -> SectionFields:
    """The fields of a ``_target_`` class (a dotted path into an installed megatron module)."""
    module, _, name = target.rpartition(".")
    where = module_file(module)
    fields = _fields_of(where, name) if where else None
    if fields is None:
        return SectionFields(
            target, None, False, f"_target_ {target} is not a class readable from the installed files"
        )
    return SectionFields(name, LazyFields(fields), True)


@functools.lru_cache(maxsize=64)
def section_fields(section: str, target: str | None = None) -> SectionFields:
    """The keys ``section`` accepts: those of its ``_target_`` class when given, else of the
    class(es) ``ConfigContainer`` declares for it (``fixed`` only when that is one concrete class)."""
    path = config_py()
    if path is None:
        return SectionFields(section, None, False, "Megatron-Bridge is not installed here")
    if target:
        return target_fields(target)
    annotation = (container_sections() or {}).get(section)
    if annotation is None:
        return SectionFields(section, None, False, "not a ConfigContainer field")
    if annotation.split("[")[0].rsplit(".", 1)[-1] in _MAPPINGS:
        return SectionFields(section, None, False, "a plain mapping", free=True)
    names = _classes_in(annotation)
    out: dict[str, Field] = {}
    open_class = False
    for name in names:
        found = find_class(path, name)
        fields = _fields_of(path, name) if found else None
        if found is None or fields is None:
            return SectionFields(name, None, False, f"{name} is not readable from the installed files")
        open_class = open_class or is_open(found[1])
        for key, f in fields.items():
            out.setdefault(key, f)
    # One concrete class: Bridge merges the file onto an instance of exactly it. A union (model,
    # dataset) or an abstract base: the base recipe picks a subclass, possibly one outside Bridge.
    fixed = len(names) == 1 and not open_class
    return SectionFields(" | ".join(names), LazyFields(out), fixed)
