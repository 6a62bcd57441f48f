"""Keeping upstream import noise off the launcher's one ``error:`` line.

Where Transformer Engine is not installed, megatron-core warns as Bridge imports it, once per
module, that TE and Apex are missing, and Bridge's import then fails on TE: the launcher's one
line says so, and everything above it only restates it. This holds stderr and warnings while the
imports run (:func:`held_import_output`) and decides what to show once they end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["ImportFailed", "held_import_output", "transformer_engine_missing"]


class ImportFailed(Exception):
    """Raised inside :func:`held_import_output` for an import that failed with its own one line."""


def transformer_engine_missing() -> bool:
    """No ``transformer_engine`` on ``sys.path``: ``find_spec`` on a top-level name runs no TE
    code, so a TE that is present but broken (its CUDA libraries) counts as present here."""
    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):  # a module without __spec__ in sys.modules: not missing
        return False


class _HeldStderr:
    """``sys.stderr`` while the imports run: keeps what is written (text, and warnings as
    :class:`warnings.WarningMessage`) until :meth:`release`, then writes through to the stream it
    replaced. A handler made during the imports (torch's loggers bind ``sys.stderr`` then) keeps
    this object as its stream, so after the release it still reaches the real one."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.held: list[str | warnings.WarningMessage] | None = []

    def write(self, text: str) -> int:
        if self.held is None:
            return int(self._real.write(text))
        self.held.append(text)
        return len(text)

    def flush(self) -> None:
        if self.held is None:
            self._real.flush()

    def hold_warning(self, *args: Any, **kwargs: Any) -> None:
        """``warnings.showwarning`` while held: the warning itself, to tell TE's apart."""
        if self.held is None:
            return
        self.held.append(warnings.WarningMessage(*args, **kwargs))

    def release(self, show: bool) -> list[str | warnings.WarningMessage]:
        held, self.held = self.held or [], None
        for item in held if show else ():
            if isinstance(item, str):
                self._real.write(item)
            else:
                warnings.showwarning(item.message, item.category, item.filename, item.lineno, item.file)
        return held

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, buffer, ...
        return getattr(self._real, name)


def _about_te(item: str | warnings.WarningMessage) -> bool:
    """A warning that Transformer Engine is missing: what the ``error:`` line says too."""
    if isinstance(item, str):
        return False
    text = str(item.message).lower()
    return "transformer engine" in text or "transformer_engine" in text


@contextlib.contextmanager
def held_import_output() -> Iterator[None]:
    """Where Transformer Engine is not installed, megatron-core warns as Bridge imports it, once
    per module, that TE and Apex are missing (4 UserWarnings, 8 lines, with core 0.16; Bridge 0.6
    also logs a traceback it catches), and then Bridge's import fails on TE and the launcher's
    ``error:`` line says so: all that output only restates it, above it. So stderr is held while
    the imports run: dropped when one fails (one note line counts what was not about TE), written
    out as it came when they succeed (a Bridge that imports without TE). Nothing is held where TE
    is installed, nor where the user set warning filters (``-W``; ``PYTHONWARNINGS=default`` shows
    it all)."""
    if sys.warnoptions or not transformer_engine_missing():
        yield
        return
    real = sys.stderr
    hold = _HeldStderr(real)
    failed: ImportFailed | None = None
    try:
        with warnings.catch_warnings():
            warnings.showwarning = hold.hold_warning
            sys.stderr = hold  # type: ignore[assignment]
            try:
                yield
            except ImportFailed as exc:
                failed = exc
            finally:
                if sys.stderr is hold:
                    sys.stderr = real
    finally:
        held = hold.release(show=failed is None)  # an exception that is not ours: shown, as a success
    if failed is None:
        return
    warned = sum(1 for item in held if not isinstance(item, str) and not _about_te(item))
    logged = sum(len(item.strip().splitlines()) for item in held if isinstance(item, str))
    if not warned and not logged:
        raise failed
    counts = f"{warned} other import warning{'s' * (warned != 1)}, {logged} log line{'s' * (logged != 1)}"
    note = f"(held back: {counts}; PYTHONWARNINGS=default shows them)"
    raise type(failed)(f"{failed}\n{note}") from None
