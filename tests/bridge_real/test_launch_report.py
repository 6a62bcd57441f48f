"""``python -m mbridge_mxfp8_plugin.launch --dry-run`` (commands/launch_report.py): the job a run would
start, built on Megatron-Bridge's real recipe flow in this process (its ``omegaconf_utils``,
``ConfigContainer`` and ``pretrain`` module; TE stood in for), then the train-start check and the
options and MXFP8 knobs as the job will use them, without training. The real run:
tests/bridge_real/test_launch.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
#: the recipe function of the tests: the real tier's tiny GPT ConfigContainer, MXFP8 knobs off
JOB = "harness.bridge_real.launcher_job:tiny_gpt_config"


# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


def _knob(out: str, name: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
    return line.split()[1]


def test_dry_run_builds_the_job_and_trains_nothing(dry_run):
    rc, out, err = dry_run("--recipe", JOB, "--config-file", str(RECIPE), "mxfp8_plugin.verify_sample=0.25")
    assert rc == 0, out + err
    assert (
        "verdict: the job would start" in out
        and "callbacks added to pretrain(): MXFP8ParamSyncCallback" in out
    )
    # the options: the file's section, then the override
    assert "  dp_size: 2\n" in out and "  verify_sample: 0.25\n" in out and "  strict: true\n" in out
    # the knobs the YAML switches on and the recipe function leaves off (the merge happened)
    assert _knob(out, "ddp.reuse_grad_buf_for_mxfp8_param_ag") == "true"
    assert "mxfp8  (from mixed_precision=bf16_with_mxfp8_mixed)" in out
    assert "MX001  pass" in out and "0 error(s)" in out
    assert not torch.distributed.is_initialized()  # pretrain() (initialize_megatron) never ran


def test_dry_run_says_when_train_start_would_refuse(dry_run):
    """No distributed optimizer: param gather cannot work (MX003). Strict, a run would refuse to
    start (exit 1); lenient, it would log and train (exit 0)."""
    off = ["ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"]
    rc, out, _ = dry_run("--recipe", JOB, "--config-file", str(RECIPE), *off)
    assert rc == 1 and "verdict: the train-start check would refuse this job" in out, out
    assert "error MX003" in out and _knob(out, "ddp.use_distributed_optimizer") == "false"
    rc, out, _ = dry_run("--recipe", JOB, "--config-file", str(RECIPE), *off, "mxfp8_plugin.strict=false")
    assert rc == 0 and "a run would log these errors and train (strict: false)" in out, out


def test_dry_run_refuses_what_a_run_refuses(dry_run):
    """The job is built as for a run: a key the ConfigContainer lacks (Bridge would skip it) and
    a recipe function that is not there stop the dry run with the run's one line."""
    rc, _, err = dry_run("--recipe", JOB, "--config-file", str(RECIPE), "+model.num_layerz=3")
    assert rc == 2 and err.count("error: ") == 1 and "model.num_layerz" in err and "num_layers" in err, err
    rc, _, err = dry_run("--recipe", JOB + "x", "--config-file", str(RECIPE))
    assert rc == 2 and "did you mean 'tiny_gpt_config'" in err, err


def test_bridges_own_recipe_package(dry_run):
    """``--recipe NAME`` imports ``megatron.bridge.recipes``, which imports every model family's
    recipes and what they need at module level (0.3-0.6: megatron-energon for Qwen-VL; 0.6 also
    diffusers). Where one is absent (this host) that is one line naming it and its install; where
    all are present, a real recipe's dry run."""
    rc, out, err = dry_run(
        "--recipe", "llama3_8b_pretrain_config", "--config-file", "llama3_8b_mxfp8_pretrain"
    )
    if rc == 2:
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert (
            errors[0].startswith("error: --recipe llama3_8b_pretrain_config: ") and "is not installed" in err
        )
        if importlib.util.find_spec("megatron.energon") is None:
            assert "megatron-energon is not installed" in err and "pip install megatron-energon" in err, err
    else:
        assert rc in (0, 1) and "plugin options (mxfp8_plugin):" in out, out + err


def test_a_disabled_plugin_with_the_weight_check_on_still_gets_its_callback(dry_run):
    """``enabled: false`` with ``verify_weights: true``: the callback still checks the weights
    (docs/verify.md), so the launcher must add it; with both off it adds none."""
    base = ["--recipe", JOB, "--config-file", str(RECIPE), "mxfp8_plugin.enabled=false"]
    rc, out, err = dry_run(*base, "mxfp8_plugin.verify_weights=true")
    assert rc == 0 and "callbacks added to pretrain(): MXFP8ParamSyncCallback (enabled false" in out, (
        out + err
    )
    rc, out, err = dry_run(*base)
    assert rc == 0 and "callbacks added to pretrain(): none (mxfp8_plugin.enabled is false)" in out, out + err
