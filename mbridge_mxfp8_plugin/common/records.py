"""Dataclasses whose methods are shared, not compiled once per class.

``dataclasses.dataclass`` writes the source of ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``
and, when frozen, ``__setattr__``/``__delattr__`` for every class, and compiles it: about 0.5 ms a
class on CPython 3.11. ``mxfp8-plugin check`` defines some twenty record classes in a process whose
budget is 1.3x ``import omegaconf, yaml`` (issue 30), so those compiles were a quarter of what it
spent above that floor. :func:`record` builds the class with ``dataclasses`` itself (init, repr and
eq off, which compiles nothing), so it stays a dataclass to every reader (``fields``, ``asdict``,
``replace``, ``is_dataclass``), and attaches one shared implementation of those methods that reads
the class's fields when called. Building an instance costs a loop instead of straight-line code;
the plugin builds hundreds, not millions.

Where it is used: the record classes ``check`` imports (its config, report and probe modules).
Elsewhere ``@dataclass`` stays, as it does for public classes that frameworks introspect beyond
``fields`` (``PluginOptions``, which OmegaConf may structure and whose ``__dataclass_params__`` it
reads): a training process pays those compiles once, beside seconds of imports.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:  # the checker's copy; 3.10 (the oldest Python supported) has no typing one
    from typing_extensions import dataclass_transform
elif sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # pragma: no cover - 3.10 at run time: the marker only informs type checkers

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda f: f


_C = TypeVar("_C", bound=type)
_set = object.__setattr__


class _Spec:
    """What the shared methods need of one class, computed once at decoration."""

    __slots__ = ("names", "defaults", "factories", "compared", "shown", "post_init")

    def __init__(self, cls: type) -> None:
        every = dataclasses.fields(cls)
        init = [f for f in every if f.init]
        missing = dataclasses.MISSING
        self.names = tuple(f.name for f in init)
        self.defaults = {f.name: f.default for f in init if f.default is not missing}
        self.factories = {f.name: f.default_factory for f in init if f.default_factory is not missing}
        self.compared = tuple(f.name for f in every if f.compare)
        self.shown = tuple(f.name for f in every if f.repr)
        self.post_init = getattr(cls, "__post_init__", None)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    spec: _Spec = type(self).__record_spec__
    kind = type(self).__qualname__
    if len(args) > len(spec.names):
        raise TypeError(f"{kind}() takes {len(spec.names)} positional arguments but {len(args)} were given")
    for name, value in zip(spec.names, args, strict=False):
        if name in kwargs:
            raise TypeError(f"{kind}() got multiple values for argument {name!r}")
        _set(self, name, value)
    for name in spec.names[len(args) :]:
        if name in kwargs:
            value = kwargs.pop(name)
        elif name in spec.defaults:
            value = spec.defaults[name]
        elif name in spec.factories:
            value = spec.factories[name]()
        else:
            raise TypeError(f"{kind}() missing required argument: {name!r}")
        _set(self, name, value)
    if kwargs:  # what the loops above did not take: no field of that name
        raise TypeError(f"{kind}() got an unexpected keyword argument {next(iter(kwargs))!r}")
    if spec.post_init is not None:
        spec.post_init(self)


def _key(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, n) for n in type(self).__record_spec__.compared)


def _repr(self: Any) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).__record_spec__.shown)
    return f"{type(self).__qualname__}({shown})"


def _eq(self: Any, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    return hash(_key(self))


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _build(cls: _C, frozen: bool) -> _C:
    """As ``dataclass`` does: a method the class writes itself is kept, except the two a frozen
    class must not have."""
    if frozen and {"__setattr__", "__delattr__"} & cls.__dict__.keys():
        raise TypeError(f"frozen @record class {cls.__qualname__} cannot define __setattr__ or __delattr__")
    undocumented = not cls.__dict__.get("__doc__")
    if undocumented:  # dataclass would ask inspect.signature for one: ~3 ms on a first call
        type.__setattr__(cls, "__doc__", cls.__name__)
    dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    if undocumented:
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        type.__setattr__(cls, "__doc__", f"{cls.__name__}({names})")
    attrs: dict[str, Any] = {"__init__": _init, "__repr__": _repr, "__eq__": _eq}
    if frozen:
        attrs.update(__hash__=_hash, __setattr__=_frozen_setattr, __delattr__=_frozen_delattr)
    elif "__eq__" not in cls.__dict__:
        attrs["__hash__"] = None  # mutable and compared by value, as a dataclass with eq=True
    for name, value in attrs.items():
        if name not in cls.__dict__ or (name == "__hash__" and cls.__dict__[name] is None):
            setattr(cls, name, value)
    type.__setattr__(cls, "__record_spec__", _Spec(cls))
    return cls


@overload
@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def record(cls: _C, /) -> _C: ...


@overload
def record(*, frozen: bool = True) -> Callable[[_C], _C]: ...


def record(cls: Any = None, /, *, frozen: bool = True) -> Any:
    """``@dataclass(frozen=True)`` (or ``@record(frozen=False)`` for ``@dataclass``) without the
    per-class compile; see the module's docstring for why and what it keeps."""
    if cls is None:
        return lambda c: _build(c, frozen)
    return _build(cls, frozen)
