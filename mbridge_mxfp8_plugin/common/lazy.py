"""Public names a package loads on first use (PEP 562), so importing it costs nothing heavy.

The package root and ``probes`` each list, per public name, the submodule that defines it: a
login node's ``check`` or ``doctor`` then imports only the modules it asks for, never torch,
megatron-core or a probe it does not run.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, where: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``where`` maps a public name to the
    submodule (relative to ``package``) that defines it; a name is looked up once, then kept
    in the package's namespace."""
    names = sorted(set(public))

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
