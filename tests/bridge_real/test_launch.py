"""``python -m mbridge_mxfp8_plugin.launch``: Bridge's recipe-script flow with the plugin switched on.

The proof runs Megatron-Bridge's real ``pretrain()`` (2 gloo ranks, as tests/bridge_real/test_bridge_real.py)
three times in one rank launch (harness/bridge_real/launcher_job.py): the shipped recipe
``tiny_gpt_mxfp8_launch`` through the launcher, the same job built in Python with
``MXFP8ParamSyncCallback`` passed by hand, and the launcher with ``mxfp8_plugin.enabled=false``.
The rest (argument and YAML errors, the argv form of ``load_recipe``) runs in this process or as
one short subprocess, without importing Bridge.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.launch import (
    LaunchError,
    _check_finetune_takes_callbacks,
    main,
    plugin_section,
    split_overrides,
)
from mbridge_mxfp8_plugin.options import PluginOptions
from mbridge_mxfp8_plugin.recipes import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
SUMMARY = "MXFP8 param-sync plugin active"
TOL = 1e-4

_BRIDGE_MISSING = [
    n
    for n in ("transformers", "modelopt", "omegaconf", "megatron.bridge")
    if importlib.util.find_spec(n) is None
]
needs_bridge = pytest.mark.skipif(
    bool(_BRIDGE_MISSING) and os.environ.get("MXFP8_REAL_BRIDGE") != "require",
    reason=f"real Bridge pretrain needs {_BRIDGE_MISSING} (requirements/bridge-real-py3.11.txt)",
)


@pytest.fixture(autouse=True)
def _plugin_logger_restored():
    """``main`` gives the plugin's logger a stderr handler when nothing is configured (as a fresh
    launcher process has it); put the logger back for the rest of the session."""
    import logging

    log = logging.getLogger("mbridge_mxfp8_plugin")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


# --------------------------------------------------------------------------- argv and YAML
def test_plugin_overrides_never_reach_bridge():
    bridge, plugin = split_overrides(
        ["train.train_iters=2", "mxfp8_plugin.strict=false", "+mxfp8_plugin.dp_size=8"]
    )
    assert bridge == ["train.train_iters=2"]
    assert plugin == ["mxfp8_plugin.strict=false", "+mxfp8_plugin.dp_size=8"]


def test_every_knob_of_the_section_and_the_overrides_is_read(tmp_path):
    """Each knob set away from its default in the file (or on the command line) comes back set."""
    flipped = {
        name: not value for name, value in PluginOptions().as_mapping().items() if isinstance(value, bool)
    }
    lines = ["mxfp8_plugin:"] + [f"  {k}: {str(v).lower()}" for k, v in flipped.items()]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n")
    options = plugin_section(path, ["mxfp8_plugin.dp_size=16", "mxfp8_plugin.verify_sample=0.25"])
    assert options.as_mapping() == {**flipped, "dp_size": 16, "verify_sample": 0.25}
    # the command line wins over the file, ~ restores the default
    options = plugin_section(path, ["mxfp8_plugin.enabled=true", "~mxfp8_plugin.strict"])
    assert options.enabled is True and options.strict is True


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--recipe", "a:b", "--bogus", "1"], ["--bogus"]),
        (["--recipe", "a:b", "train_iters"], ["train_iters", "KEY=VALUE"]),
        (["--recipe", "no_such_module_xyz:f"], ["--recipe", "no_such_module_xyz"]),
        (["--recipe", "a:b", "--config-file", "no/such.yaml"], ["--config-file", "no/such.yaml"]),
        (
            ["--recipe", "a:b", "--config-file", str(RECIPE), "mxfp8_plugin.enabeld=false"],
            ["enabeld", "enabled"],
        ),
        (["--recipe", "a:b", "--config-file", str(RECIPE), "mxfp8_plugin.strict=maybe"], ["strict", "maybe"]),
        (["--recipe", "a:b", "mxfp8_plugin.strict=["], ["mxfp8_plugin.strict=["]),
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
        "syntax",
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
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mbridge_mxfp8_plugin.launch",
            "--recipe",
            "a:b",
            "mxfp8_plugin.enabeld=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: mxfp8_plugin.enabeld is not a plugin option (did you mean 'enabled'?)"
    ]


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


# --------------------------------------------------------------------------- real pretrain()
@pytest.fixture(scope="module")
def launched():
    from harness.bridge_real.launcher_job import run_rank

    from mbridge_mxfp8_plugin.testing.launcher import launch

    timeout = float(os.environ.get("MXFP8_REAL_BRIDGE_TIMEOUT", "1500"))
    return launch(run_rank, 2, str(RECIPE), timeout=timeout)


def _losses(run):
    r = run.result
    return r.train_losses, r.eval_losses, r.test_loss


def _close(a, b):
    (ta, ea, xa), (tb, eb, xb) = a, b
    return (
        ta.keys() == tb.keys()
        and all(abs(ta[k] - tb[k]) <= TOL for k in ta)
        and [s for s, _ in ea] == [s for s, _ in eb]
        and all(abs(x - y) <= TOL for (_, x), (_, y) in zip(ea, eb, strict=True))
        and xa is not None
        and xb is not None
        and abs(xa - xb) <= TOL
    )


@needs_bridge
def test_launcher_runs_the_shipped_recipe_like_the_direct_callback(launched):
    for rank in launched:
        direct, via = rank["direct"], rank["launcher"]
        assert via.rc == 0
        # the YAML switched the MXFP8 knobs on that the recipe function leaves off
        assert via.knobs == direct.knobs and via.knobs["ddp.reuse_grad_buf_for_mxfp8_param_ag"] is True
        assert sorted(via.result.train_losses) == [1, 2, 3, 4, 5, 6]
        assert _close(_losses(via), _losses(direct)), (_losses(via), _losses(direct))
    assert SUMMARY in launched[0]["launcher"].log
    assert SUMMARY not in launched[1]["launcher"].log  # rank-zero logging


@needs_bridge
def test_launcher_with_the_plugin_disabled_adds_no_callback(launched):
    """Core 0.16.1 has A, B1 and C: without the callback the job trains differently from the
    first forced sync (eval at 3) on; before it, only A's copy-back can act."""
    rank0 = launched[0]
    off, direct = rank0["launcher_off"], rank0["direct"]
    assert off.rc == 0 and SUMMARY not in off.log and "disabled by mxfp8_plugin.enabled=false" in off.log
    assert off.knobs == direct.knobs
    after_eval = [s for s in off.result.train_losses if s > 3]
    assert any(abs(off.result.train_losses[s] - direct.result.train_losses[s]) > TOL for s in after_eval), (
        off.result.train_losses,
        direct.result.train_losses,
    )


@needs_bridge
def test_finetune_on_bridge_03_is_refused_with_the_workaround(launched):
    from importlib.metadata import version

    run = launched[0]["finetune"]
    if version("megatron-bridge").startswith("0.3."):
        errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
        assert run.rc == 2 and len(errors) == 1 and "pretrained_checkpoint" in errors[0], run.log
        assert "Traceback" not in run.log
    else:  # finetune takes callbacks: the launcher gets as far as Bridge's own checkpoint assert
        assert run.rc == -1 and "pretrained_checkpoint" in run.log, run.log
