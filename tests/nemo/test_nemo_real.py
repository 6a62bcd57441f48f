"""The Lightning adapter on NeMo 2's real stack (nemo_toolkit 2.7.3, megatron-core 0.15.3, Lightning 2.4.0).

2 CPU gloo ranks, NeMo's own ``nl.Trainer`` / ``nl.MegatronStrategy`` / ``llm.GPTModel`` /
``llm.MockDataModule`` / ``llm.train`` / ``ModelCheckpoint`` (harness: tests/harness/nemo.py).
Each mode runs in fresh processes: ``llm.train`` for 6 steps with validation and a torch_dist
checkpoint (weights and optimizer state) every 3 steps, ``trainer.test`` after it. A second launch
per mode runs ``trainer.validate`` on a fresh trainer, then ``llm.train`` resumed from that mode's
step-3 checkpoint, then ``trainer.test``.

* reference: bf16 weights, the MXFP8 rounding applied in forward, no fp8 param gather;
* plugin_off: emulated MXFP8 weights, fp8_param_gather + grad-buffer reuse + overlapped gather;
* plugin_on: the same with ``MXFP8ParamSyncLightningCallback()`` (no getter: discovery must
  find the DDP chunks under NeMo's ``MegatronParallel``).

This tier needs NeMo installed (``.ci/nemo.sh`` builds ``.venv-nemo`` from requirements/nemo.txt);
elsewhere the module is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

if importlib.util.find_spec("nemo") is None or importlib.util.find_spec("lightning") is None:
    pytest.skip(
        "NeMo tier: runs in .venv-nemo (requirements/nemo.txt) via .ci/nemo.sh", allow_module_level=True
    )

import harness.nemo as h  # noqa: E402

TOL = 1e-4
MODES = ("reference", "mxfp8", "plugin")
LN_VOCAB = math.log(h.VOCAB)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nemo"))


@pytest.fixture(scope="module")
def runs(workdir):
    """Per mode, per rank: losses, recorded events, checkpoint directory."""
    return {mode: h.launch_nemo(h.run, mode, workdir) for mode in MODES}


@pytest.fixture(scope="module")
def replica():
    """harness/lightning_loop.py's ``nemo_real`` order, plugin off and on, in one launch."""
    from harness.lightning_loop import run_lightning_orders

    return run_lightning_orders(["nemo_real"], modes=("mxfp8", "plugin"), train_steps=6, val_every=3)


@pytest.fixture(scope="module")
def checkpoints(runs, resumed):
    """Each mode's NeMo checkpoints (after steps 3 and 6), read back with dist_checkpointing (in the
    mode's resumed launch, after its run)."""
    return {
        mode: [resumed[mode]["checkpoints"][p] for p in h.checkpoint_dirs(runs[mode][0]["ckpt_dir"])]
        for mode in MODES
    }


@pytest.fixture(scope="module")
def resumed(runs, workdir):
    """Per mode, rank 0: ``trainer.validate`` on the fresh model, then ``llm.train`` resumed from
    that mode's own step-3 checkpoint (weights, optimizer state, data position) to step 6, then
    ``trainer.test``; then reads back the mode's checkpoints. Validating first, resuming and reading
    share one launch per mode."""
    return {
        mode: h.launch_nemo(
            h.run,
            mode,
            f"{workdir}/resume",
            resume_from=h.checkpoint_dirs(runs[mode][0]["ckpt_dir"])[0],
            validate_first=True,
            read_back=tuple(h.checkpoint_dirs(runs[mode][0]["ckpt_dir"])),
        )[0]
        for mode in MODES
    }


def test_runs_complete_and_ranks_agree(runs):
    for mode, (r0, r1) in runs.items():
        assert [s for s, _ in r0["train"]] == [1, 2, 3, 4, 5, 6], mode
        assert [(s, fit) for s, fit, _ in r0["val"]] == [(3, True), (6, True)], mode
        assert r0["test"] is not None, mode
        assert str((r0["train"], r0["val"], r0["test"])) == str((r1["train"], r1["val"], r1["test"])), mode
        assert len(h.checkpoint_dirs(r0["ckpt_dir"])) == 2, mode


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_losses_match_reference(runs, plugin):
    ref = runs["reference"][0]
    got = runs["plugin" if plugin else "mxfp8"][0]
    pairs = (
        [("val", a[2], b[2]) for a, b in zip(ref["val"], got["val"], strict=True)]
        + [("train", a[1], b[1]) for a, b in zip(ref["train"], got["train"], strict=True)]
        + [("test", ref["test"], got["test"])]
    )
    if plugin:
        bad = [(k, r, g) for k, r, g in pairs if not abs(r - g) <= TOL]
        assert not bad, f"plugin run differs from the reference: {bad}"
    else:
        # The defects, as NeMo shows them: every step's pre-hook gathers the zeroed shared buffer,
        # so the model computes with zero weights (uniform logits): loss ln(vocab).
        assert abs(got["train"][0][1] - LN_VOCAB) < 1e-3 and abs(ref["train"][0][1] - LN_VOCAB) > 1e-3
        vals = [(r, g) for k, r, g in pairs if k == "val"]
        assert all(abs(r - g) > 1e-3 for r, g in vals), vals


def _expected_weights(ref: dict, mxfp8_keys: set[str]) -> dict:
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_quantize

    return {k: (mxfp8_quantize(v) if k in mxfp8_keys else v) for k, v in ref.items()}


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_checkpoint_saves_hold_current_weights(checkpoints, plugin):
    """NeMo's torch_dist saves after steps 3 (on_save_checkpoint) and 6 (weights-only, no hook)."""
    got_all = checkpoints["plugin" if plugin else "mxfp8"]
    for save, (ref, got) in enumerate(zip(checkpoints["reference"], got_all, strict=True)):
        mx_keys = {k for k in ref if k.rsplit(".", 2)[-2] in h.MXFP8_LINEARS and k.endswith(".weight")}
        assert len(mx_keys) == 4 and set(ref) == set(got)
        expected = _expected_weights(ref, mx_keys)
        worst = {k: float((got[k] - expected[k]).abs().max()) for k in expected}
        if plugin:
            assert max(worst.values()) <= 1e-6, (save, worst)
        else:
            assert max(worst.values()) > 1e-3, (save, worst)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
def test_validate_before_fit(resumed, plugin):
    """``trainer.validate`` on a fresh trainer before any fit: NeMo wraps the model in DDP and
    builds a distributed optimizer for it, the pre-hooks gather the shared buffer."""
    ref = resumed["reference"]["val"][0]
    got = resumed["plugin" if plugin else "mxfp8"]["val"][0]
    assert ref[:2] == got[:2] == (0, False)
    if plugin:
        assert abs(ref[2] - got[2]) <= TOL, (ref, got)
    else:
        # B as NeMo shows it: the first pre-hook gathers the zeroed buffer (uniform logits).
        assert abs(got[2] - LN_VOCAB) < 1e-3 and abs(ref[2] - LN_VOCAB) > 1e-3, (ref, got)


@pytest.mark.parametrize("mode", MODES, ids=["reference", "plugin_off", "plugin_on"])
def test_resumed_train_continues_the_reference(runs, resumed, mode):
    """A resumed ``llm.train`` (after that validate), steps 4-6, and ``trainer.test`` after it:
    the reference's and the plugin's train losses and test loss are the uninterrupted reference's
    (the checkpoint holds the weights, Adam's state and the data position of step 3). Validation is
    not compared: Lightning 2.4 resumes a checkpoint written in ``on_train_batch_end`` one batch
    early in its epoch count (``_TrainingEpochLoop.reset``: ``batch_progress.reset_on_restart()``),
    so the resumed run validates at step 4, the uninterrupted one at 3 and 6."""
    ref = runs["reference"][0]
    got = resumed[mode]
    assert [s for s, _ in got["train"]] == [4, 5, 6]
    pairs = [("train", a[1], b[1]) for a, b in zip(ref["train"][3:], got["train"], strict=True)]
    pairs.append(("test", ref["test"], got["test"]))
    if mode != "mxfp8":
        bad = [p for p in pairs if not abs(p[1] - p[2]) <= TOL]
        assert not bad, f"resumed {mode} run differs from the uninterrupted reference: {bad}"
    else:
        # The resumed run gathers the zeroed shared buffer at its first pre-hook, as a fresh run does.
        assert abs(got["train"][0][1] - LN_VOCAB) < 1e-3
        assert all(abs(r - g) > 1e-3 for _, r, g in pairs), pairs


@pytest.mark.parametrize("mode", ["mxfp8", "plugin"], ids=["plugin_off", "plugin_on"])
def test_replica_nemo_order_is_the_real_stack(runs, replica, mode):
    """harness/lightning_loop.py's ``nemo_real`` order fires the same hooks, NeMo events, pre-hook
    toggles and forced param syncs, at the same steps, as NeMo's real stack for this config."""
    real = runs[mode][0]["events"]
    assert "force_param_sync@3" in real and "on_save_checkpoint@3" in real
    assert replica[("nemo_real", mode)][0].events == real
