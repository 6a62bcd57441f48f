"""``python -m mbridge_mxfp8_plugin.launch``: what is judged before Megatron-Bridge is imported.

Arguments, the YAML, the ``mxfp8_plugin`` section and ``check``'s input rules are read first, in
this process, without importing Bridge; where Bridge itself is absent the launcher says so in
one line. The real job (Bridge's ``pretrain()``, a broken Transformer Engine) is
tests/bridge_real/test_launch.py, ``--dry-run`` on Bridge's recipe flow
tests/bridge_real/test_launch_report.py, and the exit status of a refusal tests/unit/test_exit_codes.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.adapters.recipes import RecipeError, load_recipe
from mbridge_mxfp8_plugin.commands.launch import (
    LaunchError,
    _check_finetune_takes_callbacks,
    main,
    plugin_options,
)
from mbridge_mxfp8_plugin.config.read import split_overrides
from mbridge_mxfp8_plugin.options import PluginOptions

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
#: A base venv of the release matrix: torch, omegaconf, hydra, no megatron at all (.ci/matrix.sh).
BARE_PY = ROOT / ".venv-matrix-py3.11" / "bin" / "python"


# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


def _launch(argv: list[str], python: Path | str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "mbridge_mxfp8_plugin.launch", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",  # harness.* for the recipe functions of the tests
        timeout=600,
        env={**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore", **env},
    )


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


# --------------------------------------------------------------------------- argv and YAML
def test_plugin_overrides_never_reach_bridge():
    bridge, plugin = split_overrides(
        ["train.train_iters=2", "mxfp8_plugin.strict=false", "+mxfp8_plugin.dp_size=8", "~mxfp8_plugin"]
    )
    assert bridge == ["train.train_iters=2"]
    assert plugin == ["mxfp8_plugin.strict=false", "+mxfp8_plugin.dp_size=8", "~mxfp8_plugin"]


def test_every_knob_of_the_section_and_the_overrides_is_read(tmp_path):
    """Each knob set away from its default in the file (or on the command line) comes back set."""
    flipped = {
        name: not value for name, value in PluginOptions().as_mapping().items() if isinstance(value, bool)
    }
    lines = ["mxfp8_plugin:"] + [f"  {k}: {str(v).lower()}" for k, v in flipped.items()]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n")
    options = plugin_options(path, ["mxfp8_plugin.dp_size=16", "mxfp8_plugin.verify_sample=0.25"])
    assert options.as_mapping() == {**flipped, "dp_size": 16, "verify_sample": 0.25}
    # the command line wins over the file, ~ restores the default (also of an option the file lacks)
    options = plugin_options(
        path, ["mxfp8_plugin.enabled=true", "~mxfp8_plugin.strict", "~mxfp8_plugin.dp_size"]
    )
    assert options.enabled is True and options.strict is True and options.dp_size is None


def test_a_plugin_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  train_iters: 2\nmxfp8_plugin: true\n")
    for read in (lambda: plugin_options(path), lambda: load_recipe(path)):
        with pytest.raises(RecipeError, match="mxfp8_plugin must be a mapping of plugin options, got True"):
            read()


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--recipe", "a:b", "--bogus", "1"], ["--bogus"]),
        (["--recipe", "a:b", "train_iters"], ["train_iters", "KEY=VALUE"]),
        (["--recipe", "no_such_module_xyz:f"], ["--recipe", "no_such_module_xyz", "PYTHONPATH"]),
        (["--recipe", "a:b", "--config-file", "no/such.yaml"], ["--config-file", "no/such.yaml"]),
        (
            ["--recipe", "a:b", "--config-file", str(RECIPE), "mxfp8_plugin.enabeld=false"],
            ["enabeld", "enabled"],
        ),
        (["--recipe", "a:b", "--config-file", str(RECIPE), "mxfp8_plugin.strict=maybe"], ["strict", "maybe"]),
        (["--recipe", "a:b", "mxfp8_plugin.strict=["], ["mxfp8_plugin.strict=["]),
        (
            ["--recipe", "a:b", "--config-file", str(RECIPE), "train.train_iters=[1,"],
            ["train.train_iters=[1,"],
        ),
        (["--recipe", "a:b", "--mode", "train"], ["--mode", "train"]),
        ([], ["--recipe"]),
    ],
    ids=[
        "unknown-flag",
        "not-key-value",
        "recipe-module",
        "config-file",
        "knob-typo",
        "knob-type",
        "plugin-syntax",
        "bridge-syntax",
        "mode",
        "no-recipe",
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, names, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, (name, err)


def test_as_a_module_bad_input_prints_no_traceback():
    proc = _launch(["--recipe", "a:b", "mxfp8_plugin.enabeld=false"])
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert line.startswith("error: mxfp8_plugin.enabeld is not a plugin option (did you mean 'enabled'?)"), (
        line
    )


_IMPORTED = (
    "import sys; from mbridge_mxfp8_plugin.commands.launch import main; rc = main(sys.argv[1:]); "
    "print('imported:', sorted(m for m in ('megatron.bridge', 'transformer_engine', 'harness.mx_cases') "
    "if m in sys.modules)); sys.exit(rc)"
)


@pytest.mark.parametrize("typo", [False, True], ids=["control", "key-typo"])
def test_keys_are_checked_before_the_recipe_or_bridge_is_imported(typo):
    """A key ``check`` knows to be wrong stops the launch before anything heavy is imported. The
    control, without the typo, gets as far as importing the recipe's module (a cheap one of the
    tests, which has no such function: refused there, before Bridge)."""
    argv = ["--recipe", "harness.mx_cases:no_such_recipe", "--config-file", str(RECIPE)]
    argv += ["+ddp.overlap_param_gathr=true"] if typo else []
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTED, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",
        timeout=300,
        env={**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"},
    )
    line = _one_error_line(proc.stderr)
    assert proc.returncode == (1 if typo else 2)  # check's error on the inputs: check's exit 1
    if typo:
        assert "ddp.overlap_param_gathr" in line and "overlap_param_gather" in line, line
        assert "imported: []" in proc.stdout, proc.stdout
    else:
        assert "has no 'no_such_recipe'" in line, line
        assert "imported: ['harness.mx_cases']" in proc.stdout, proc.stdout


def test_without_megatron_bridge_one_line_names_it_and_the_fix():
    """The release matrix's base venv has torch, OmegaConf and Hydra but no megatron at all."""
    if not BARE_PY.exists():
        pytest.skip(f"{BARE_PY} not built (.ci/matrix.sh builds it)")
    proc = _launch(
        ["--recipe", "llama3_8b_pretrain_config", "--config-file", str(RECIPE), "train.train_iters=3"],
        python=BARE_PY,
        PYTHONPATH=str(ROOT),
    )
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert "Megatron-Bridge is not installed" in line and "pip install megatron-bridge" in line, line


def test_finetune_refused_only_where_it_takes_no_callbacks():
    def finetune_03(config, forward_step_func):  # Bridge 0.3.x's signature
        ...

    def finetune_04(config, forward_step_func, callbacks=None):  # Bridge >= 0.4.0
        ...

    _check_finetune_takes_callbacks(finetune_04, ["plugin"])
    _check_finetune_takes_callbacks(finetune_03, [])  # plugin disabled: nothing to add
    with pytest.raises(LaunchError, match=r"0\.4\.0.*pretrained_checkpoint"):
        _check_finetune_takes_callbacks(finetune_03, ["plugin"])


def test_load_recipe_takes_bridge_argv(tmp_path):
    """A Bridge script's ``sys.argv[1:]`` (``--config-file x.yaml`` then overrides) used to reach
    Hydra's lexer as an override ("--config-file" is no key=value)."""
    extra = tmp_path / "x.yaml"
    extra.write_text("train:\n  train_iters: 3\nmxfp8_plugin:\n  strict: false\n")
    data, options = load_recipe(
        RECIPE, ["--config-file", str(extra), "train.eval_iters=5", "mxfp8_plugin.prestage=false"]
    )
    assert data["train"]["train_iters"] == 3 and data["train"]["eval_iters"] == 5
    assert data["ddp"]["fp8_param_gather"] is True  # the first file's keys stay
    assert (options.strict, options.prestage, options.dp_size) == (False, False, 2)
    data, _ = load_recipe(RECIPE, [f"--config_file={extra}"])
    assert data["train"]["train_iters"] == 3
    with pytest.raises(RecipeError, match="--recipe"):
        load_recipe(RECIPE, ["--recipe", "llama3_8b_pretrain_config"])
