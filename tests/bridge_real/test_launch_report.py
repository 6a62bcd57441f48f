"""``python -m mbridge_mxfp8_plugin.launch --dry-run`` (commands/launch_report.py): the job a run would
start, built on Megatron-Bridge's real recipe flow in this process (its ``omegaconf_utils``,
``ConfigContainer`` and ``pretrain`` module; TE stood in for), then the train-start check and the
options and MXFP8 knobs as the job will use them, without training. The real run:
tests/bridge_real/test_launch.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.commands.launch import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
#: the recipe function of the tests: the real tier's tiny GPT ConfigContainer, MXFP8 knobs off
JOB = "harness.bridge_real.launcher_job:tiny_gpt_config"

_BRIDGE_MISSING = [
    n
    for n in ("transformers", "modelopt", "omegaconf", "megatron.bridge")
    if importlib.util.find_spec(n) is None
]

# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


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


SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
#: seeded bad (and merely surprising) inputs on the launcher's shipped file
SEEDED = {
    "type": ["train.train_iters=abc"],
    "enum": ["mixed_precision=bogus"],
    "misspelt_key": ["model.num_layerz=3"],
    "deletion": ["~train.nope"],
    # the user's true, which the recipe's comm_overlap overwrites: a warning, the job starts
    "overwritten_by_comm_overlap": ["optimizer.overlap_param_gather_with_optimizer_step=true"],
    # the same knob where comm_overlap takes it from: an error for all three
    "in_comm_overlap": ["+comm_overlap.overlap_param_gather_with_optimizer_step=true"],
    # a written false that mixed_precision silently replaces: check's error, judged on the file
    "replaced_by_mixed_precision": ["ddp.reuse_grad_buf_for_mxfp8_param_ag=false"],
    # MoE implied by an expert knob, the param gather not overlapped
    "implied_moe": ["model.expert_model_parallel_size=2", "comm_overlap.overlap_param_gather=false"],
    "addition_of_a_field": ["+model.moe_router_topk=2"],
    "no_distopt": ["ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"],
    "reuse_in_ddp_only": ["optimizer.reuse_grad_buf_for_mxfp8_param_ag=false"],
    "lenient": ["optimizer.reuse_grad_buf_for_mxfp8_param_ag=false", "mxfp8_plugin.strict=false"],
}
CASES = {f"shipped:{p.stem}": (p, []) for p in SHIPPED} | {k: (RECIPE, v) for k, v in SEEDED.items()}


def _real_launch(argv: list[str]) -> tuple[int, list[Any]]:
    """``main()`` without ``--dry-run``: the launcher's real path (prepare, its own refusal, the
    entry call, the exit-status mapping). Bridge's ``pretrain()`` is stood in for by what the
    plugin's callback does first at ``on_train_start``: the train-start config check on the built
    container (``validate_config``, strict as the options say). The real ``pretrain()`` runs the
    shipped tiny recipe in tests/bridge_real/test_launch.py; the shipped large recipes cannot train
    on 2 CPU ranks."""
    from mbridge_mxfp8_plugin import validate_config
    from mbridge_mxfp8_plugin.commands import launch as launch_module

    started: list[Any] = []
    real_entry = launch_module._entry

    def entry(mode: str) -> Any:
        real_entry(mode)  # Bridge's own module imports, as a run does

        def pretrain(config: Any, forward_step: Any, callbacks: Any = None) -> None:
            options = callbacks[0].options if callbacks else None
            if options is not None and options.validate:
                validate_config(config, plugin=options, strict=options.strict)
            started.append(config)

        return pretrain

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_module, "_entry", entry)
        rc = main(argv)
    return rc, started


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_the_dry_run_and_a_real_launch_are_one_judge(dry_run, case, capsys):
    """``check FILE OVERRIDES --recipe JOB``, the launcher's dry run and its real run on the same
    inputs give the same exit status and, where they refuse, name the same errors; a lenient job
    (strict false) is refused by check alone, which has no strict: the dry run says it would log
    the errors and train, and so does the real run."""
    from harness.bridge_cpu import bridge_on_cpu
    from harness.check_io import run as run_check

    path, overrides = CASES[case]
    argv = ["--recipe", JOB, "--config-file", str(path), *overrides]
    rc_dry, out, err = dry_run(*argv)
    rc_check, check_out, check_err = run_check(path, overrides, recipe_name=JOB, installed=None)
    with bridge_on_cpu():
        rc_run, started = _real_launch(argv)
    run_err = capsys.readouterr().err
    told = f"{case}: dry run {rc_dry}, real run {rc_run}, check {rc_check}\n{out}{err}\n{run_err}\n"
    told += check_out + check_err
    assert rc_dry == rc_run and bool(started) == (rc_run == 0), told
    if case == "lenient":
        assert rc_check == 1 and rc_dry == 0 and "log these errors and train (strict: false)" in out, told
        return
    assert rc_dry == rc_check, told
    if rc_dry == 0:
        assert "verdict: the job would start" in out and "0 error(s)" in check_out, told
    elif rc_dry == 1:
        errors = {ln.split()[1] for ln in check_out.splitlines() if ln.startswith("error MX")}
        assert errors, told
        assert all(f"error {rule}" in out + err for rule in errors), told
        assert sorted(errors)[0] in run_err or any(rule in run_err for rule in errors), told
    else:  # unreadable input: one line from each
        assert err.count("error: ") == 1 and check_err.count("error: ") == 1, told


def test_a_real_run_refuses_what_check_refuses_before_pretrain(monkeypatch, capsys):
    """Not only the dry run: a strict real run stops on check's error on its inputs (exit 1, one
    line), before ``pretrain()``, though the built container alone would pass the train-start
    check (mixed_precision replaces the written false)."""
    from harness.bridge_cpu import bridge_on_cpu

    from mbridge_mxfp8_plugin.commands import launch as launch_module

    started: list[object] = []
    argv = ["--recipe", JOB, "--config-file", str(RECIPE), "ddp.reuse_grad_buf_for_mxfp8_param_ag=false"]
    with bridge_on_cpu():
        launch = launch_module.prepare(argv)
        launch.entry = lambda *a, **k: started.append(a)  # pretrain() must not be reached
        monkeypatch.setattr(launch_module, "prepare", lambda _argv: launch)
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and not started, (rc, err)
    assert err.count("error: ") == 1 and "MX005" in err and "strict=false" in err, err
    launch.options = launch.options.replace(strict=False)
    assert launch.file_refusal() == []  # lenient: logged by check's report, and the job trains
