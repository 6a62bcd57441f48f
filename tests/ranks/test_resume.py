"""Defect F through the loop API: a resumed run equals the uninterrupted one bit for bit.

Real megatron-core over 2 gloo ranks, the toy job, Megatron-LM's loop order (the first step after
a resume runs with the forward pre-hooks off) and Bridge 0.6's (a resumed run keeps them on); the
checkpoint and the load are in process (tests/harness/resume_loop.py says what they hold). Every
case compares the resumed run's train losses after the resume, its eval losses and every tensor
its params and fp32 main shards hold at the end with the uninterrupted run's, with ``==``.

The kit's value-holding MXFP8 param has no column-wise copy, and re-quantizing dequantized values
gives the same values, so a correct checkpoint cannot show F there; what it shows is a checkpoint
whose weights are not its main params' (a save without the plugin), which the same fix repairs.
"""

from __future__ import annotations

import math

import pytest
from harness.resume_loop import EVALS, ITERS, SAVE_AT

pytestmark = pytest.mark.matrix  # every release-pair cell: F's fix and its passivity by loop order

#: the kit's two MXFP8 params: values only (``values``), Transformer Engine's shape (``te``)
KINDS = ("values", "te")

#: name -> (order, fix on, checkpoint weights, planted subnormal band)
CASES = {
    "fix_on": ("megatron_lm", True, "current", True),
    "fix_off": ("megatron_lm", False, "current", True),
    "unrefreshed_fix_on": ("megatron_lm", True, "unrefreshed", False),
    "unrefreshed_fix_off": ("megatron_lm", False, "unrefreshed", False),
    "hooks_on_resume": ("hooks_on_resume", True, "current", True),
}


@pytest.fixture(scope="module")
def all_runs():
    from harness.resume_loop import rank_body

    from mbridge_mxfp8_plugin.testing import launch

    cases = [(o, kind, fix, w, plant) for kind in KINDS for o, fix, w, plant in CASES.values()]
    per_rank = launch(rank_body, 2, cases, timeout=900)
    names = [(kind, name) for kind in KINDS for name in CASES]
    return {key: [r[i] for r in per_rank] for i, key in enumerate(names)}


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def runs(all_runs, kind):
    return {name: all_runs[kind, name] for name in CASES}


def _same(a: dict[int, float], b: dict[int, float]) -> bool:
    """Equal, NaN included (a checkpoint of gathered gradients trains on NaN on every rank)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _differences(full, resumed) -> list[str]:
    """Everything after the resume that is not bit-identical, by name."""
    out = [
        f"train loss {s}"
        for s in range(SAVE_AT + 1, ITERS + 1)
        if resumed.train_losses[s] != full.train_losses[s]
    ]
    out += [f"eval loss {s}" for s in EVALS if resumed.eval_losses[s] != full.eval_losses[s]]
    assert resumed.final.keys() == full.final.keys()
    out += [k for k in full.final if not full.final[k].equal(resumed.final[k])]
    return out


def _resume_event(run):
    events = [h for h in run.history if h[0] == "resume"]
    assert len(events) == 1, run.history
    return events[0]


def test_ranks_agree_and_the_resume_ran_where_it_should(runs):
    for name, per_rank in runs.items():
        a, b = per_rank
        assert _same(a["resumed"].train_losses, b["resumed"].train_losses), name
        assert sorted(a["resumed"].train_losses) == list(range(SAVE_AT + 1, ITERS + 1)), name
        assert sorted(a["full"].eval_losses) == list(EVALS), name


@pytest.mark.parametrize("fix", [True, False], ids=["fix_on", "fix_off"])
def test_resume_from_a_correct_checkpoint(runs, kind, fix):
    for rank, run in enumerate(runs["fix_on" if fix else "fix_off"]):
        diff = _differences(run["full"], run["resumed"])
        event = _resume_event(run["resumed"])
        if fix:
            assert diff == [], (rank, diff[:8])
            # one all-gather per bucket group: the params re-derived from the loaded main params
            assert event[1].startswith("resume: re-derived") and event[2] > 0, event
        elif kind == "values":
            # values only, no column-wise copy: re-quantizing the saved values gives them back
            assert diff == [], (rank, diff[:8])
        else:
            # The column-wise copy the backward pass reads was quantized from dequantized row-wise
            # values: the first step's input gradients differ, and so do the main params it
            # updates. (Measured: ~2.5e3 main elements by <= 4e-6 at lr 1e-4; the final codes
            # differ on core 0.16.1, not on 0.19.2, and the losses stay equal in fp32: the
            # difference is below the bf16 resolution of the activations.)
            assert any(k.startswith("main.") for k in diff), diff


@pytest.mark.parametrize("fix", [True, False], ids=["fix_on", "fix_off"])
def test_resume_from_a_checkpoint_saved_without_the_plugin(runs, fix):
    """Its weights are not its main params': the first step after the resume computes with them
    unless the params are re-derived; the optimizer state is right, so the fix restores the run."""
    for rank, run in enumerate(runs["unrefreshed_fix_on" if fix else "unrefreshed_fix_off"]):
        diff = _differences(run["full"], run["resumed"])
        if fix:
            assert diff == [], (rank, diff[:8])
        else:
            # stale weights (core < 0.18) or gathered gradients read as weights (later cores: NaN)
            assert f"train loss {SAVE_AT + 1}" in diff, diff[:8]
            loss = SAVE_AT + 1
            assert not abs(run["resumed"].train_losses[loss] - run["full"].train_losses[loss]) <= 1e-3


def test_passive_where_the_first_step_gathers_the_main_params(runs):
    """Bridge >= 0.6's order: the pre-hooks stay on, the loop stages, the first forward gathers."""
    for rank, run in enumerate(runs["hooks_on_resume"]):
        assert _differences(run["full"], run["resumed"]) == [], rank
        event = _resume_event(run["resumed"])
        assert event[1] == "resume: the first forward gathers the staged main params" and event[2] == 0
