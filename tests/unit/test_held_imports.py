"""``commands/held_imports.py``: where Transformer Engine is missing, the launcher holds what
megatron-core and Bridge write while they import, and shows it only where the import succeeded
(the launcher's whole stderr then is its one ``error:`` line: tests/bridge_real/test_launch.py
runs that end to end)."""

from __future__ import annotations

import sys
from typing import Any

import pytest


def _held_run(monkeypatch, capsys, *, te_missing: bool, fail: bool, warnoptions: tuple[str, ...] = ()):
    """``held_import_output`` around a TE warning, another warning and a log line (an import
    failure at the end when ``fail``): ``(the error it raised or None, the stderr shown)``."""
    import warnings

    from mbridge_mxfp8_plugin.commands import held_imports

    monkeypatch.setattr(held_imports, "transformer_engine_missing", lambda: te_missing)
    monkeypatch.setattr(sys, "warnoptions", list(warnoptions))
    raised = None

    def to_stderr(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():  # as outside pytest: filters on, warnings written to stderr
        warnings.simplefilter("always")
        warnings.showwarning = to_stderr
        try:
            with held_imports.held_import_output():
                warnings.warn("Transformer Engine and Apex are not installed.", UserWarning, stacklevel=1)
                warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
                print("a log line", file=sys.stderr)
                if fail:
                    raise held_imports.ImportFailed("megatron.bridge: Transformer Engine is not installed")
        except held_imports.ImportFailed as exc:
            raised = str(exc)
    return raised, capsys.readouterr().err


def test_without_transformer_engine_a_failed_import_drops_what_it_held(monkeypatch, capsys):
    raised, err = _held_run(monkeypatch, capsys, te_missing=True, fail=True)
    assert err == "", err
    first, note = raised.splitlines()  # the TE warning is dropped; the other two are counted
    assert first == "megatron.bridge: Transformer Engine is not installed"
    assert note.startswith("(held back: 1 other import warning, 1 log line;"), note


def test_without_transformer_engine_a_successful_import_shows_what_it_held_in_order(monkeypatch, capsys):
    raised, err = _held_run(monkeypatch, capsys, te_missing=True, fail=False)
    assert raised is None
    te, apex, log = (err.index(t) for t in ("Transformer Engine and Apex", "Apex is not", "a log line"))
    assert te < apex < log, err


@pytest.mark.parametrize("why", ["te_installed", "warnoptions"])
def test_nothing_is_held_with_transformer_engine_or_the_users_filters(monkeypatch, capsys, why):
    kw: dict[str, Any] = {"te_missing": why != "te_installed"}
    kw["warnoptions"] = ("default",) if why == "warnoptions" else ()
    raised, err = _held_run(monkeypatch, capsys, fail=True, **kw)
    assert raised == "megatron.bridge: Transformer Engine is not installed"  # no note: nothing held
    assert "Transformer Engine and Apex" in err and "Apex is not" in err and "a log line" in err, err
