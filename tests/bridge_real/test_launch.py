"""``python -m mbridge_mxfp8_plugin.launch``: Bridge's recipe-script flow with the plugin switched on.

The proof runs Megatron-Bridge's real ``pretrain()`` (2 gloo ranks, as tests/bridge_real/test_bridge_real.py)
three times in one rank launch (harness/bridge_real/launcher_job.py): the shipped recipe
``tiny_gpt_mxfp8_launch`` through the launcher, the same job built in Python with
``MXFP8ParamSyncCallback`` passed by hand, and the launcher with ``mxfp8_plugin.enabled=false``.
``--dry-run`` runs in this process on the same recipe flow (Bridge's ``omegaconf_utils``,
``ConfigContainer`` and ``pretrain`` module; TE stood in for), and a missing or broken Transformer
Engine, or Bridge's recipe package failing to import, must each be one line and exit 2. What is
judged before Bridge is imported is tests/unit/test_launch_args.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mbridge_mxfp8_plugin.commands.launch import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
#: the recipe function of the tests: the real tier's tiny GPT ConfigContainer, MXFP8 knobs off
JOB = "harness.bridge_real.launcher_job:tiny_gpt_config"
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


# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


# --------------------------------------------------------------------------- --dry-run
@pytest.fixture(scope="module")
def dry_run():
    """``main(["--dry-run", ...])`` in this process on Bridge's real recipe flow (its
    ``omegaconf_utils``, ``pretrain`` module and ``ConfigContainer``), TE and CUDA stood in for by
    ``bridge_on_cpu``; returns ``(exit status, stdout, stderr)``."""
    from harness.bridge_cpu import bridge_on_cpu

    def run(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with bridge_on_cpu(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--dry-run", *argv])
        return rc, out.getvalue(), err.getvalue()

    if _BRIDGE_MISSING and os.environ.get("MXFP8_REAL_BRIDGE") != "require":
        pytest.skip(f"needs {_BRIDGE_MISSING}")
    return run


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


# --------------------------------------------------------------------------- Transformer Engine
_TE_BROKEN = "raise OSError('libcudart.so.12: cannot open shared object file: No such file or directory')\n"


def test_transformer_engine_missing_or_broken_is_one_line(tmp_path):
    """Bridge's package import reaches Transformer Engine (peft's LoRA layers). Absent (this host),
    or present but failing to load its CUDA libraries (a stand-in package that raises as TE's own
    ``__init__`` does then), the launcher answers in one line naming TE and the fix."""
    broken = tmp_path / "broken_te"
    (broken / "transformer_engine").mkdir(parents=True)
    (broken / "transformer_engine" / "__init__.py").write_text(_TE_BROKEN)
    argv = [sys.executable, "-m", "mbridge_mxfp8_plugin.launch", "--dry-run", "--recipe", JOB]
    argv += ["--config-file", str(RECIPE)]
    # absolute: the children run in tests/ (a release-matrix cell is a relative PYTHONPATH entry)
    path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        **os.environ,
        "NO_VCS_VERSION": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(path),
    }
    cases = {"broken": {**env, "PYTHONPATH": os.pathsep.join([str(broken), *path])}}
    if importlib.util.find_spec("transformer_engine") is None:
        cases["missing"] = env
    procs = {
        name: subprocess.Popen(
            argv, cwd=ROOT / "tests", env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, e in cases.items()
    }
    results = {name: p.communicate(timeout=600) for name, p in procs.items()}
    for name, (_, err) in results.items():
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        # ours is the last line: Bridge 0.6's own import logs TE tracebacks it catches, before it
        assert (
            procs[name].returncode == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0]
        ), (
            name,
            err,
        )
        assert "Transformer Engine" in errors[0] and "transformer_engine[pytorch]" in errors[0], errors[0]
    if "missing" in results:
        assert "no module named 'transformer_engine'" in results["missing"][1]
    assert "failed in transformer_engine (OSError: libcudart.so.12" in results["broken"][1]


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
