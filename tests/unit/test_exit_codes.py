"""One exit-code table for every command (common/exit_codes.py): the same refusal exits 1 from
``check``, the launcher's dry run and its real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.adapters.recipes import load_recipe
from mbridge_mxfp8_plugin.commands.launch import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"

# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


def test_a_strict_refusal_exits_1_in_a_real_run_as_in_the_dry_run_and_check(monkeypatch, capsys):
    """The same refusal reads the same from every judge. The real run's refusal is the train-start
    check the callback runs at ``on_train_start`` (``validate_config(..., strict=True)``), raised
    here from inside ``Launch.run`` on the file's config, where Bridge's ``pretrain()`` would raise it."""
    from mbridge_mxfp8_plugin import validate_config
    from mbridge_mxfp8_plugin.commands import launch as launch_module
    from mbridge_mxfp8_plugin.commands.check import run_check

    override = "ddp.overlap_grad_reduce=false"  # MX006: an error on every release
    config, _ = load_recipe(RECIPE, [override])

    class RefusedAtTrainStart:
        dry_run = False

        def run(self, callbacks: object) -> None:
            validate_config(config, strict=True)

    monkeypatch.setattr(launch_module, "prepare", lambda argv: RefusedAtTrainStart())
    rc = main(["--recipe", "any:fn", "--config-file", str(RECIPE), override])
    err = capsys.readouterr().err
    assert rc == 1 and "error: " in err and "overlap_grad_reduce" in err, (rc, err)
    assert run_check(str(RECIPE), [override]) == 1
