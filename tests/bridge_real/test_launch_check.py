"""``check`` and the launcher are one judge (commands/launch_check.py): ``check FILE OVERRIDES
--recipe JOB``, the launcher's ``--dry-run`` and its real run agree on the exit status and the
errors named, on every shipped recipe and on seeded bad inputs, on Megatron-Bridge's real recipe
flow in this process (its ``omegaconf_utils``, ``ConfigContainer`` and ``pretrain`` module; TE
stood in for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mbridge_mxfp8_plugin.commands.launch import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
#: the recipe function of the tests: the real tier's tiny GPT ConfigContainer, MXFP8 knobs off
JOB = "harness.bridge_real.launcher_job:tiny_gpt_config"


# ``main`` gives the plugin's logger a stderr handler (tests/conftest.py puts it back after each test).
pytestmark = pytest.mark.usefixtures("plugin_logger_restored")


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
    # disabled: no train-start check runs, so nothing refuses the job (check still names MX009)
    "disabled": ["mxfp8_plugin.enabled=false"],
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
    if case == "disabled":  # check has no "enabled" switch either; the launcher starts the job
        assert rc_dry == 0 and "enabled is false, so a run adds no callback" in out, told
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
