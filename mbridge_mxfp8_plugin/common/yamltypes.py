"""Judging a YAML value against a Python type, and writing values back as YAML.

Generic: knows nothing of Megatron-Bridge or the plugin, so the options type, the config
column and the recipe helpers share it without importing one another. The one type YAML cannot
judge alone, a torch dtype name, is the :data:`DTYPE` marker: its checker (which names the
installed Bridge converts) is passed in by the caller that knows it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import yaml

from .records import record

__all__ = [
    "DTYPE",
    "DtypeCheck",
    "EnumType",
    "closest",
    "describe_type",
    "example_value",
    "plain_data",
    "suggest",
    "type_problem",
    "yaml_literal",
]


class _Dtype:
    """The annotation of a ``torch.dtype`` field (accepted from YAML as a dtype *name*)."""

    def __repr__(self) -> str:
        return "DTYPE"


DTYPE: Any = _Dtype()


@record
class EnumType:
    """An enum-typed field, described by its members (read from source, never imported).

    What OmegaConf accepts for a field whose value is an enum member, which is what Bridge's
    override merge does with it: a member name (``flash`` or ``AttnBackend.flash``), or an
    integer value of an int enum.
    """

    name: str
    members: tuple[str, ...]
    values: tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if isinstance(value, str):
            name = value.removeprefix(f"{self.name}.")
            return name in self.members or value in self.values
        return isinstance(value, int) and value in self.values


#: value -> None if it names a dtype, else what was expected.
DtypeCheck = Callable[[Any], "str | None"]


def closest(word: str, choices: Iterable[object]) -> str | None:
    """The closest valid name, for typos (``dpp`` -> ``ddp``)."""
    import difflib  # only when there is a typo to explain

    close = difflib.get_close_matches(word, sorted(str(c) for c in choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: Iterable[object]) -> str:
    """' (did you mean X?)' for a close match, else ''."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def _union_args(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def example_value(annotation: Any) -> str:
    """A YAML literal of the right type, for fix snippets."""
    if annotation is DTYPE:
        return "bfloat16"
    if isinstance(annotation, EnumType) and annotation.members:
        return annotation.members[0]
    if typing.get_origin(annotation) is typing.Literal:
        return yaml_literal(typing.get_args(annotation)[0])
    args = [a for a in _union_args(annotation) or () if a is not type(None)]
    if args:
        return example_value(args[0])
    return {bool: "true  # or false, unquoted", int: "1", float: "1.0", str: "name"}.get(annotation, "...")


_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def describe_type(annotation: Any) -> str:
    """A short human name for an annotation, for 'expected ...' messages."""
    if annotation is DTYPE:
        return "a torch dtype name such as 'bfloat16', or null"
    args = _union_args(annotation)
    if args is not None:
        names = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if annotation in _NAMES:
        return _NAMES[annotation]
    if isinstance(annotation, EnumType):
        return f"one of {annotation.name}'s members: {', '.join(annotation.members)}"
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return f"a {getattr(annotation, '__name__', None) or annotation}"


def type_problem(value: Any, annotation: Any, dtype_check: DtypeCheck | None = None) -> str | None:
    """``None`` if ``value`` fits ``annotation`` as YAML can express it, else the expectation.

    Strict where it matters: ``1`` or ``"true"`` is not a boolean (a quoted ``"false"`` is truthy
    in Python and would silently turn a knob *on*), ``true`` is not an integer. A :data:`DTYPE`
    is judged by ``dtype_check``; without one any value passes (who converts it is unknown).
    """
    if annotation is Any or annotation is None:
        return None
    if annotation is DTYPE:
        return None if dtype_check is None else dtype_check(value)
    args = _union_args(annotation)
    if args is not None:
        if any(type_problem(value, a, dtype_check) is None for a in args):
            return None
        return describe_type(annotation) + _did_you_mean(value, args)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        ok = value in choices and type(value) in {type(c) for c in choices}
        return None if ok else describe_type(annotation) + _did_you_mean(value, (annotation,))
    if isinstance(annotation, EnumType):
        return (
            None
            if annotation.accepts(value)
            else describe_type(annotation) + _did_you_mean(value, (annotation,))
        )
    if annotation is type(None):
        return None if value is None else "null"
    if annotation is bool:
        return None if isinstance(value, bool) else describe_type(bool)
    if annotation is int:
        # Hydra and OmegaConf read ``4e7`` as a float; Bridge sets it as is and megatron-core only
        # compares it, so an integral float is accepted where an integer is expected.
        integral = isinstance(value, float) and value.is_integer()
        ok = (isinstance(value, int) and not isinstance(value, bool)) or integral
        return None if ok else describe_type(int)
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else describe_type(float)
    if annotation is str:
        return None if isinstance(value, str) else describe_type(str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return None if isinstance(value, (list, tuple)) else "a list"
    if origin is dict or annotation is dict:
        return None if isinstance(value, Mapping) else "a mapping"
    return None  # callables, enums, nested configs: not something a YAML knob check can judge


def _did_you_mean(value: Any, members: Iterable[Any]) -> str:
    """' (did you mean X?)' for a misspelt enum or literal value (``mxfp9`` -> ``mxfp8``)."""
    if not isinstance(value, str):
        return ""
    names: list[str] = []
    for m in members:
        if isinstance(m, EnumType):
            names += m.members
        elif typing.get_origin(m) is typing.Literal:
            names += [str(c) for c in typing.get_args(m) if isinstance(c, str)]
    return suggest(value, names) if names else ""


def plain_data(value: Any) -> Any:
    """``value`` as YAML/JSON-safe builtins (anything else as its ``str``)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    return str(value)


def yaml_literal(value: Any) -> str:
    """A value as the user writes it in YAML (``true``, ``null``), not as Python prints it."""
    text = yaml.safe_dump(plain_data(value), default_flow_style=True).strip()
    return text.removesuffix("...").strip()
