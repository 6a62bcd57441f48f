"""Packaging promises: light imports, a console script, a clean no-op outside reuse mode."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback, MXFP8UsageError, ParamSyncEngine


def test_import_does_not_pull_bridge_lightning_or_megatron():
    code = (
        "import sys, mbridge_mxfp8_plugin as m; m.MXFP8ParamSyncCallback();"
        "bad=[k for k in sys.modules if k.startswith(('megatron', 'lightning', 'pytorch_lightning'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_callback_registers_through_real_bridge_callback_manager():
    from harness.bridge_loop import load_bridge_callbacks

    cb_mod = load_bridge_callbacks()
    manager = cb_mod.CallbackManager()
    manager.add([MXFP8ParamSyncCallback()])
    expected = {
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_train_end",
        "on_eval_start",
        "on_eval_end",
        "on_test_start",
        "on_test_end",
    } & set(cb_mod.VALID_EVENTS)
    assert {e for e in cb_mod.VALID_EVENTS if manager.has_callbacks(e)} == expected


def test_callback_is_a_noop_for_models_that_are_not_megatron_ddp(caplog):
    import torch

    cb = MXFP8ParamSyncCallback()
    ctx = SimpleNamespace(model=[torch.nn.Linear(2, 2)], optimizer=None, state=None)
    with caplog.at_level("INFO", logger="mbridge_mxfp8_plugin"):
        for hook in ("on_train_start", "on_train_step_start", "on_eval_start", "on_eval_end", "on_train_end"):
            getattr(cb, hook)(ctx)
    assert cb.engine is None
    assert sum("inactive" in r.getMessage() for r in caplog.records) == 1


def test_engine_rejects_non_ddp_with_actionable_message():
    import torch

    with pytest.raises(MXFP8UsageError, match="not megatron-core DistributedDataParallel"):
        ParamSyncEngine([torch.nn.Linear(2, 2)])


def test_cli_and_recipe_lookup_import_nothing_heavy():
    """``check`` and ``doctor`` run on login nodes without torch; the CLI's parser and the shipped
    recipe lookup must not drag it (or a YAML reader) in before a subcommand asks for it."""
    code = (
        "import sys; from mbridge_mxfp8_plugin.commands import cli;"
        "from mbridge_mxfp8_plugin.config import recipe_files;"
        "cli.build_parser(); recipe_files.recipe_path('tiny_debug_mxfp8');"
        "heavy={'torch', 'megatron', 'yaml', 'omegaconf', 'hydra'};"
        "bad=[k for k in sys.modules if k.split('.')[0] in heavy];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _documented_paths() -> dict[str, str]:
    """Every ``mbridge_mxfp8_plugin.x.y`` the README, the docs and the shipped recipes show -> where."""
    root = Path(__file__).resolve().parents[2]
    found: dict[str, str] = {}
    for path in [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "recipes").glob("*.yaml")),
    ]:
        for match in re.finditer(r"mbridge_mxfp8_plugin(?:\.\w+)+", path.read_text(encoding="utf-8")):
            found.setdefault(match.group(0), str(path.relative_to(root)))
    return found


DOCUMENTED = _documented_paths()


def test_the_docs_show_import_paths() -> None:
    """Without paths found the test below would pass on nothing."""
    assert {
        "mbridge_mxfp8_plugin.lightning",
        "mbridge_mxfp8_plugin.launch",
        "mbridge_mxfp8_plugin.recipes",
    } <= set(DOCUMENTED)


@pytest.mark.parametrize("dotted", sorted(DOCUMENTED))
def test_every_documented_import_path_resolves(dotted: str) -> None:
    """A module path imports; ``module.name`` resolves to an attribute (Lightning's path needs Lightning)."""
    if dotted.split(".")[1] == "lightning":
        pytest.importorskip("lightning")
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            assert hasattr(obj, name), f"{dotted} ({DOCUMENTED[dotted]}): {obj!r} has no {name!r}"
            obj = getattr(obj, name)
        return
    raise AssertionError(f"{dotted} ({DOCUMENTED[dotted]}) does not import")
