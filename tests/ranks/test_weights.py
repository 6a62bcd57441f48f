"""``verify_weights`` (verify/weights.py) on real megatron-core over 2 gloo ranks, in Megatron-LM's loop
order: silent at init; each defect case with one of the plugin's fixes left out fires, and is silent
with it in (B at eval and train end, A on mis-indexed params, C on the step after a forced sync,
expert-parallel buffers); the fused kernel judges as the type's own write; a check's plans are
reused and read the current bits; and the option (``PluginOptions(verify_weights=True)``) on the
loop API across a save and a resume; in every pass, whatever its kind, the fused kernel judges the
kit's TE-shaped type (harness.verify_codes). Expectations are gated on what
:func:`~mbridge_mxfp8_plugin.probe_core` finds in the installed cell (docs/upstream.md), not on the
verifier. Cases: harness.verify_cases (one launch per session for the four verifier test files).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


@pytest.fixture(scope="module")
def runs(verify_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records of harness.verify_cases (one launch per session: tests/ranks/conftest.py)."""
    return verify_runs


@pytest.fixture(scope="module")
def behaviour(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the installed megatron-core does by itself (probed in the ranks): each defect
    expectation holds only where the release has that defect."""
    return dict(runs[0]["behaviour"])


def test_silent_at_init(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["init"].ok, r["init"].message()
        assert r["init"].params_checked > 0 and r["init"].groups_reduced == 1


@pytest.mark.parametrize("mode", ["off", "b1_off", "b2_off"])
def test_fires_at_eval_without_b_fixes(
    runs: list[dict[str, Any]], behaviour: dict[str, Any], mode: str
) -> None:
    # Staged but not written back (b1_off) is wrong only where core does not write forced gathers
    # back (< 0.18); the other two are wrong everywhere (stale, or the gathered gradients).
    fires = not (mode == "b1_off" and behaviour["forced_sync_writes_back"])
    for r in runs:
        rep = r[f"b:{mode}"]["eval"]
        assert (not rep.ok and rep.shard_mismatch_count > 0) == fires, rep.message()


def test_b_silent_with_plugin_on(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for event in ("eval", "train_end"):
            rep = r["b:on"][event]
            assert rep.ok, rep.message()


def test_fires_at_train_end_without_plugin(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert not r["b:off"]["train_end"].ok


def test_a_fires_on_misindexed_params(runs: list[dict[str, Any]], behaviour: dict[str, Any]) -> None:
    for r in runs:
        off, on = r["a:off"], r["a:on"]
        rep = off["report"]
        if behaviour["pads_bucket_offsets"]:
            # Core honours the padding: nothing is mis-indexed, so nothing to expose.
            assert not off["misindexed"] and rep.ok, rep.message()
        else:
            assert off["misindexed"], "an unpadded core should mis-index the toy's params (A)"
            assert not rep.ok and rep.shard_mismatch_count > 0, rep.message()
            assert {m.name for m in rep.shard_mismatches} <= off["misindexed"]
        assert on["report"].ok, on["report"].message()


def test_c_fires_on_the_step_after_a_forced_sync(
    runs: list[dict[str, Any]], behaviour: dict[str, Any]
) -> None:
    for r in runs:
        # Core >= 0.19 re-arms the pre-hooks itself when the loop stages (C fixed upstream).
        assert r["c:c_off"]["report"].ok == bool(behaviour["has_dispatch_reset"])
        assert r["c:c_fixed"]["report"].ok, r["c:c_fixed"]["report"].message()
        assert r["c:on"]["report"].ok, r["c:on"]["report"].message()


def test_expert_parallel_buffers(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        case = r["expert"]
        assert case["expert_params"] == 2
        stale, rep = case["stale"], case["report"]
        assert not stale.ok and any(m.name.startswith("module.layers.1.") for m in stale.shard_mismatches)
        assert rep.ok and rep.params_hashed == 6, rep.message()


def _fused_expected() -> bool:
    """Where the fused kernel must be used: TE-shaped params (codes) with Triton importable and
    able to run on these CPU tensors (its interpreter). ``MXFP8_EXPECT_FUSED`` (the Makefile's
    TE-shaped pass) makes it a requirement, so a missing Triton fails instead of passing vacuously."""
    if "MXFP8_EXPECT_FUSED" in os.environ:
        return os.environ["MXFP8_EXPECT_FUSED"] == "1"
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import param_kind

    triton = importlib.util.find_spec("triton") is not None
    wanted = os.environ.get("MXFP8_VERIFY_FUSED", "1") != "0"
    return param_kind() == "te" and triton and wanted and os.environ.get("TRITON_INTERPRET") == "1"


def test_fused_kernel_judges_as_the_types_own_write(runs: list[dict[str, Any]]) -> None:
    """The fused cast-and-compare (verify/fused.py) names the same params, elements and worst
    differences as the type's own write path, and is used exactly where it can be."""
    for r in runs:
        case = r["sampling"]
        on, off = case["one_block_full"], case["one_block_full_unfused"]
        small = case["one_block_full_small"]
        assert not on.ok and not off.ok
        for other in (off, small):
            assert [(m.name, m.elements, m.max_abs_diff) for m in on.shard_mismatches] == [
                (m.name, m.elements, m.max_abs_diff) for m in other.shard_mismatches
            ], (on.message(), other.message())
        assert (on.elements_checked, on.params_checked) == (off.elements_checked, off.params_checked)
        used = [p for p in case["clean_full"].reference_paths if "fused" in p]
        assert bool(used) == _fused_expected(), case["clean_full"].reference_paths
        assert not any("fused" in p for p in off.reference_paths), off.reference_paths


def test_plans_reused_and_read_current_bits(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        rec = run["plans"]
        assert rec["full_made"] == 1 and rec["full_ok"] == [True, True], rec
        assert rec["sampled_made"] == 1, rec  # one plan serves every phase of the rotation
        assert all(rec["sampled_ok"]), rec
        assert not rec["corrupt"].ok and rec["corrupt"].shard_mismatch_count == 1, rec["corrupt"].message()
        assert rec["restored"].ok and rec["made_while_corrupt"] == 0
        assert rec["moved"].ok and rec["made_after_move"] == 1
        assert not rec["moved_changed"].ok, rec["moved_changed"].message()


def test_a_kept_graph_is_launched_before_the_layout_is_checked_and_read_only_if_it_holds(
    runs: list[dict[str, Any]],
) -> None:
    """The replay overlaps the layout's check (issue 32: a sample's fixed host cost), which is an
    identity check of the objects the plan was made from; a new fingerprint is taken only where
    one differs. A main shard replaced by a changed copy: the launched replay read the old, still
    allocated shard and said ok; the identity check fails, the fingerprint differs, and the
    report is the new plan's. That copy re-pointed to new memory (``.data =``): no launch (its
    address changed), and the new memory is read. Python's cyclic collector is off during each
    check and on after it, and a replayed check leaves it nothing to collect."""
    for run in runs:
        rec = run["early"]
        assert rec["first"].ok and rec["first_log"] == ["chunks", "fingerprint", "replay"], rec["first_log"]
        # the kept graph goes first, before the model's chunks are found
        assert rec["second"].ok and rec["second_log"] == ["replay", "chunks", "unchanged"], rec["second_log"]
        replaced = rec["replaced"]
        assert rec["replaced_log"] == ["replay", "chunks", "unchanged", "fingerprint", "replay"], rec[
            "replaced_log"
        ]
        assert not replaced.ok and [m.name for m in replaced.shard_mismatches] == [rec["param"]], (
            replaced.message()
        )
        assert rec["moved_log"] == ["chunks", "fingerprint", "replay"], rec["moved_log"]
        assert not rec["moved"].ok, rec["moved"].message()
        # Python's cyclic collector is paused for a check (its passes walk the job's heap), and
        # back on after it
        assert rec["collector"] == ([False] * 6, True), rec["collector"]
        # A replayed check leaves nothing for that collector (a reference cycle made at every
        # call tips its count, and its pass then lands in a later check: 9 objects a call before
        # the model's chunks were found without a recursive closure)
        assert rec["steady"].ok and rec["steady_log"] == ["replay", "chunks", "unchanged"], rec["steady_log"]
        assert rec["left_for_the_collector"] == 0, rec["left_for_the_collector"]


# ------------------------------------------------------------------ the option (loop API)
def _writes_back(runs: list[dict[str, Any]]) -> bool:
    return bool(runs[0]["behaviour"]["forced_sync_writes_back"])


def test_option_disabled_plugin_raises_at_first_eval(runs: list[dict[str, Any]]) -> None:
    # No fix at all: the toy loop stages nothing before its forced sync, on every release the
    # eval reads stale weights (core < 0.18) or the gathered gradients (>= 0.18).
    for r in runs:
        case = r["opt:disabled"]
        assert case["error"] and "MXFP8 weight check at eval (loop API): WRONG" in case["error"], case


def test_option_b1_off_reports_at_eval_where_core_does_not_write_back(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        case = r["opt:b1_off"]
        assert case["error"] is None  # strict=False: reported, not raised
        if _writes_back(runs):
            # Core writes the forced gather back itself: the plugin's write-back is not needed.
            assert all(rep is None or rep.ok for rep in case["reports"].values()), case
            assert case["errors"] == []
        else:
            assert not case["reports"]["eval"].ok
            if rank == 0:
                assert case["errors"] and "at eval (loop API): WRONG" in case["errors"][0]


def test_option_b2_off_reports_at_eval(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        case = r["opt:b2_off"]
        assert case["error"] is None and not case["reports"]["eval"].ok, case
        assert bool(case["errors"]) == (rank == 0)  # one rank-zero line per event
        if rank == 0:
            assert "at eval (loop API): WRONG" in case["errors"][0]


def test_option_silent_with_plugin_on_across_save_and_resume(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        case = r["opt:on"]
        assert case["error"] is None and case["errors"] == [], case
        reports = case["reports"]
        assert {"eval", "train_end", "load", "resumed eval"} <= {
            k for k, v in reports.items() if v is not None
        }
        # The save is checked before its forced sync only where core does not write it back.
        assert (reports["save"] is None) == _writes_back(runs)
        for event, rep in reports.items():
            assert rep is None or (rep.ok and rep.params_checked > 0), (event, rep.message())


def test_option_resume_from_a_stale_checkpoint_fires_at_load(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        case = r["opt:stale_ckpt"]
        load = case["reports"]["load"]
        assert not load.ok and "checkpoint load (loop API)" in load.message()
        if rank == 0:
            assert any("at checkpoint load (loop API): WRONG" in line for line in case["errors"])


# ------------------------------------------- params holding codes, in every pass (harness.verify_codes)
def _kernel_expected() -> bool:
    """Where the fused kernel must judge the TE-shaped case, whatever the pass's kind: Triton
    importable and able to run on these CPU tensors (its interpreter), and not turned off
    (``MXFP8_VERIFY_FUSED=0``). ``MXFP8_EXPECT_FUSED`` makes it a requirement either way."""
    if "MXFP8_EXPECT_FUSED" in os.environ:
        return os.environ["MXFP8_EXPECT_FUSED"] == "1"
    triton = importlib.util.find_spec("triton") is not None
    wanted = os.environ.get("MXFP8_VERIFY_FUSED", "1") != "0"
    return triton and wanted and os.environ.get("TRITON_INTERPRET") == "1"


def test_the_fused_kernel_judges_te_shaped_params_in_every_pass(runs: list[dict[str, Any]]) -> None:
    """The default pass too runs the fused kernel (issue 32.5): on the kit's TE-shaped type, real
    shards of rows of 256 and 128 elements, the full check and every phase of the default sample
    are silent on current weights, and the report names the kernel as the judge of the MXFP8
    weights (the type's own write where the kernel is off)."""
    expected = _kernel_expected()
    for r in runs:
        case = r["codes"]
        for rep in (case["clean"]["full"], *case["clean"]["sampled"], case["restored"]):
            assert rep.ok and rep.mxfp8_checked > 0 and not rep.unchecked, rep.message()
            paths = [p for p in rep.reference_paths if p.startswith("TEShapedMXFP8Tensor via ")]
            assert paths and all(("fused" in p) == expected for p in paths), rep.reference_paths


def test_a_sampled_check_rereads_what_its_plan_reads_at_every_call(runs: list[dict[str, Any]]) -> None:
    """What a replayed sampled check re-reads at every call and what only in rotation (issue 32:
    the layout's re-read was most of a 1B sampled check's time). A weight's codes re-bound to a
    flipped copy, and its scale-layout mark set with its scale bytes changed in place: no call of
    the rotation is blind to either, and the next call reports each as the new layout reads it
    (WRONG; NOT CHECKED where owned, never WRONG). Undone, both are OK again. (harness.verify_codes)"""
    for r in runs:
        case = r["rotation"]
        name = case["name"]
        assert case["warm"].ok, case["warm"].message()
        assert case["rebound_blind"] == [], case["rebound_blind"]
        rebound = case["rebound"]
        assert rebound.verdict == "wrong", rebound.message()
        if case["owner"]:
            assert name in [m.name for m in rebound.shard_mismatches], rebound.message()
        assert case["swizzled_blind"] == [], case["swizzled_blind"]
        swizzled = case["swizzled"]
        assert swizzled.verdict == ("not checked" if case["owner"] else "ok"), swizzled.message()
        if case["owner"]:
            assert swizzled.unchecked_types == ["TEShapedMXFP8Tensor"], swizzled.message()
            assert any(u.startswith(f"{name}: ") and "swizzled" in u for u in swizzled.unchecked), (
                swizzled.unchecked
            )
        for back in ("rebound_back", "swizzled_back"):
            assert case[back].ok and not case[back].unchecked, case[back].message()
