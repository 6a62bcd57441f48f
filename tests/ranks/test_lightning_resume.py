"""Defect F through ``MXFP8ParamSyncLightningCallback``: ``Trainer.fit(ckpt_path=...)`` from a real
Lightning checkpoint equals the uninterrupted fit bit for bit (tests/harness/lightning_resume.py).

TE-shaped MXFP8 params with the planted subnormal band (harness.resume_loop.planted_band), 2 gloo
ranks, 6 steps in two epochs of 3, validation after each epoch, the checkpoint after epoch 0.
Loop orders of tests/harness/lightning_loop.py: ``bridge`` (the first step of a fit runs with the
pre-hooks off: the callback re-derives the params at the first batch after the restore) and
``nemo`` (pre-hooks on, the callback stages the main params before each step: the first forward
gathers them, and the resume needs nothing).
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

#: name -> (loop order, fix on)
CASES = {"bridge": ("bridge", True), "bridge_fix_off": ("bridge", False), "nemo": ("nemo", True)}


@pytest.fixture(scope="module")
def runs():
    from harness.lightning_resume import rank_body

    from mbridge_mxfp8_plugin.testing import launch

    per_rank = launch(rank_body, 2, [(o, "te", fix) for o, fix in CASES.values()], timeout=900)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES)}


def _differences(full, resumed) -> list[str]:
    out = [
        f"train loss {i + 4}"
        for i, (a, b) in enumerate(zip(full["train"][3:], resumed["train"], strict=True))
        if a != b
    ]
    if full["val"][-1:] != resumed["val"]:
        out.append("validation after the resume")
    assert full["final"].keys() == resumed["final"].keys() and full["final"]
    out += [k for k in full["final"] if not full["final"][k].equal(resumed["final"][k])]
    return out


def _resume_event(run):
    events = [h for h in run["resumed"]["history"] if h[0] == "resume"]
    assert len(events) == 1, run["resumed"]["history"]
    return events[0]


def test_the_fits_are_what_they_claim(runs):
    for name, per_rank in runs.items():
        full, resumed = per_rank[0]["full"], per_rank[0]["resumed"]
        assert len(full["train"]) == 6 and len(resumed["train"]) == 3, name
        assert len(full["val"]) == 2 and len(resumed["val"]) == 1, name
        assert per_rank[0]["resumed"]["train"] == per_rank[1]["resumed"]["train"], name
        assert any("columnwise" in k for k in full["final"]), name


@pytest.mark.parametrize("fix", [True, False], ids=["fix_on", "fix_off"])
def test_resume_with_the_first_step_on_loaded_params(runs, fix):
    for run in runs["bridge" if fix else "bridge_fix_off"]:
        diff = _differences(run["full"], run["resumed"])
        if fix:
            assert diff == [], diff[:8]
            event = _resume_event(run)
            assert event[1].startswith("resume: re-derived") and event[2] > 0, event
        else:
            assert any("columnwise" in k for k in diff) and any(k.startswith("main.") for k in diff), diff[:8]


def test_passive_where_the_first_forward_gathers_the_staged_main_params(runs):
    for run in runs["nemo"]:
        assert _differences(run["full"], run["resumed"]) == []
        event = _resume_event(run)
        assert event[1] == "resume: the first forward gathers the staged main params" and event[2] == 0
