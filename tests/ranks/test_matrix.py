"""Release-pair matrix: the installed megatron-core with the loop order of its Megatron-Bridge.

Run by ``.ci/matrix.sh`` once per venv (megatron-core 0.14.0 ... 0.19.2). ``MXFP8_BRIDGE_LOOP``
picks the Bridge loop order to replay (default: the Bridge release paired with the installed core).
Each cell runs train -> eval -> train -> save -> eval -> save -> test on 2 gloo ranks, three ways
(reference, plugin off, plugin on), and asserts:

* plugin off shows exactly the defects docs/compatibility.md lists for the pair, no others;
* plugin on matches the reference within 1e-4 (every train, eval and test loss);
* on a pair where core and loop need nothing (core 0.19 + Bridge 0.6) the plugin is passive:
  the same number of param all-gathers at every callback, and bit-identical DDP buffers.
"""

from __future__ import annotations

import math
import os
from importlib import metadata

import pytest

os.environ.setdefault("NO_VCS_VERSION", "1")

TOL = 1e-4


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


CORE = _minor(metadata.version("megatron-core"))
#: the Bridge release each megatron-core is used with (Bridge's own pins / release dates)
PAIRED_LOOP = {
    "0.14": "0.3.1",
    "0.15": "0.3.1",
    "0.16": "0.3.1",
    "0.17": "0.4.2",
    "0.18": "0.5.1",
    "0.19": "0.6.2",
    "0.20": "0.6.2",  # Megatron-LM main (0.20.0-dev): Bridge main's loop keeps 0.6's order (doctor)
}
LOOP = os.environ.get("MXFP8_BRIDGE_LOOP") or PAIRED_LOOP.get(CORE, "0.3.1")

#: What plugin-off shows by (core, Bridge loop), from docs/upstream.md's defect table:
#:   A            bucket param_to_index ignores the 64-element padding (core <= 0.16)
#:   eval_stale   first eval runs on the previous iteration's weights (B1: core <= 0.17)
#:   eval_garbage first eval runs on gathered gradients (B2 with B1 fixed: core >= 0.18, loop < 0.5)
#:   C            the training steps after an eval run polluted (core <= 0.18)
EXPECTED: dict[tuple[str, str], set[str]] = {}
for _core in ("0.14", "0.15", "0.16"):
    for _loop in ("0.3", "0.4", "0.5"):
        EXPECTED[(_core, _loop)] = {"A", "eval_stale", "C"}
for _loop in ("0.3", "0.4", "0.5"):
    EXPECTED[("0.17", _loop)] = {"eval_stale", "C"}
EXPECTED.update(
    {
        ("0.18", "0.3"): {"eval_garbage", "C"},
        ("0.18", "0.4"): {"eval_garbage", "C"},
        ("0.18", "0.5"): {"C"},
        ("0.19", "0.3"): {"eval_garbage"},
        ("0.19", "0.4"): {"eval_garbage"},
        ("0.19", "0.5"): set(),
        ("0.19", "0.6"): set(),
    }
)
# Megatron-LM main (0.20.0-dev, docs/compatibility.md): A, B1 and C stay fixed, so as 0.19.
EXPECTED.update({("0.20", loop): EXPECTED[("0.19", loop)] for loop in ("0.3", "0.4", "0.5", "0.6")})
CELL = (CORE, _minor(LOOP))

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.skipif(
        CELL not in EXPECTED,
        reason=f"megatron-core {CORE} with the Bridge {LOOP} loop is not a supported pair "
        "(Bridge 0.6 calls prepare_model_params_for_param_sync, which needs megatron-core >= 0.19)",
    ),
]

EVAL_INTERVAL = 3
FIRST_EVAL = EVAL_INTERVAL


def _schedule():  # type: ignore[no-untyped-def]
    from harness.bridge_loop import LoopSchedule

    # evals after steps 3 and 6, an interval save after step 5 (no eval in that iteration), the
    # release's end-of-run save, then pretrain's test evaluation.
    return LoopSchedule(train_iters=7, eval_interval=EVAL_INTERVAL, eval_iters=2, save_interval=5)


@pytest.fixture(scope="module")
def runs():  # type: ignore[no-untyped-def]
    from harness.scenarios import run_bridge_scenario

    print(f"\nmatrix cell: megatron-core {metadata.version('megatron-core')}, Bridge loop order {LOOP}")
    out = {}
    modes = ["reference", "mxfp8", "plugin"]
    if CORE in ("0.14", "0.15", "0.16"):
        modes.append("aligned")  # B and C in isolation from A
    for mode in modes:
        out[mode] = run_bridge_scenario(
            mode, _schedule(), loop=LOOP, run_test=True, instrument=mode != "reference", keep_weights=False
        )[0]
    return out


def _close(a: float, b: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= TOL


def observed_defects(runs) -> set[str]:  # type: ignore[no-untyped-def]
    """Classify what plugin-off did against the reference (losses are DP-averaged, rank 0's view)."""
    ref, off = runs["reference"], runs["mxfp8"]
    seen: set[str] = set()
    if off.offset_mismatches_before:
        seen.add("A")
    iso = runs.get("aligned", off)  # B/C observed without A's wrong slices
    assert all(
        _close(a, b)
        for a, b in zip(iso.train_losses[:FIRST_EVAL], ref.train_losses[:FIRST_EVAL], strict=False)
    ), (
        "training before the first eval already differs from the reference (beyond defect A): "
        f"{iso.train_losses[:FIRST_EVAL]} vs {ref.train_losses[:FIRST_EVAL]}"
    )
    first = iso.eval_losses[FIRST_EVAL]
    ref_first = ref.eval_losses[FIRST_EVAL]
    if not _close(first, ref_first):
        seen.add("eval_garbage" if not math.isfinite(first) or abs(first - ref_first) > 1.0 else "eval_stale")
    after = slice(FIRST_EVAL, 2 * FIRST_EVAL)  # the steps between the first and second eval
    if not all(_close(a, b) for a, b in zip(iso.train_losses[after], ref.train_losses[after], strict=False)):
        seen.add("C")
    return seen


def test_cell_is_what_the_matrix_asked_for() -> None:
    want = os.environ.get("MXFP8_MATRIX_CELL")
    if want:
        assert want == "core" + metadata.version("megatron-core").split("+")[0].replace(".", "")[:4], (
            f"venv for {want} runs megatron-core {metadata.version('megatron-core')}"
        )


def test_plugin_off_shows_exactly_the_defects_of_this_pair(runs) -> None:  # type: ignore[no-untyped-def]
    seen = observed_defects(runs)
    assert seen == EXPECTED[CELL], (
        f"megatron-core {CORE} + Bridge {LOOP} loop: expected {sorted(EXPECTED[CELL])}, saw {sorted(seen)}; "
        f"eval ref {runs['reference'].eval_losses} off {runs['mxfp8'].eval_losses}"
    )


def test_plugin_matches_reference(runs) -> None:  # type: ignore[no-untyped-def]
    ref, on = runs["reference"], runs["plugin"]
    assert len(on.train_losses) == len(ref.train_losses)
    bad_train = [
        (i + 1, a, b)
        for i, (a, b) in enumerate(zip(on.train_losses, ref.train_losses, strict=False))
        if not _close(a, b)
    ]
    assert not bad_train, f"train losses (step, plugin, reference) off by > {TOL}: {bad_train}"
    assert set(on.eval_losses) == set(ref.eval_losses) == {3, 6, -1}
    bad_eval = {
        k: (on.eval_losses[k], ref.eval_losses[k])
        for k in ref.eval_losses
        if not _close(on.eval_losses[k], ref.eval_losses[k])
    }
    assert not bad_eval, f"eval/test losses (plugin, reference) off by > {TOL}: {bad_eval}"
    assert on.offset_mismatches_after == 0


def test_loop_order_fired_the_release_events(runs) -> None:  # type: ignore[no-untyped-def]
    from harness.bridge_loop import loop_order

    order = loop_order(LOOP)
    events = runs["plugin"].loop_events
    start = events.index("on_train_start")
    first_disable = events.index("disable_forward_pre_hook(param_sync=False)")
    assert (start < first_disable) == order.on_train_start_before_disable
    assert ("on_checkpoint_save" in events) == order.fires_on_checkpoint_save
    assert ("stage_main_params(0.5)" in events) == order.stage_before_eval
    assert events.count("on_eval_start") == 2 and events.count("on_test_start") == 1


@pytest.mark.skipif(EXPECTED.get(CELL) != set(), reason="only where core and loop need nothing")
def test_plugin_is_passive_where_nothing_is_broken(runs) -> None:  # type: ignore[no-untyped-def]
    ref, off, on = runs["reference"], runs["mxfp8"], runs["plugin"]
    assert all(_close(a, b) for a, b in zip(off.train_losses, ref.train_losses, strict=False))
    assert off.all_gathers == on.all_gathers, (
        f"plugin issued {on.all_gathers - off.all_gathers} extra all-gathers"
    )
    assert [e for e, _, _ in off.trace] == [e for e, _, _ in on.trace]
    for (event, n_off, d_off), (_, n_on, d_on) in zip(off.trace, on.trace, strict=False):
        assert n_off == n_on, f"all-gathers differ by {event}: off {n_off}, plugin {n_on}"
        assert d_off == d_on, f"DDP buffers differ after {event}: the plugin wrote into them"
    for event, stats in on.plugin_events:
        assert stats["all_gathers"] == 0 and not stats["staged"], (event, stats)
        assert stats["params_written"] == 0 and stats["buckets_zeroed"] == 0, (event, stats)


@pytest.mark.skipif(EXPECTED.get(CELL) == set(), reason="the plugin has nothing to fix here")
def test_defect_detection_can_fail(runs) -> None:  # type: ignore[no-untyped-def]
    """Plugin off must differ from the reference here, or the matrix proves nothing."""
    ref, off = runs["reference"], runs["mxfp8"]
    assert any(not _close(a, b) for a, b in zip(off.train_losses, ref.train_losses, strict=False)) or any(
        not _close(off.eval_losses[k], ref.eval_losses[k]) for k in ref.eval_losses
    )


def test_eval_only_job() -> None:
    """Bridge skip_train: pre-hooks never disabled, no optimizer in any callback context."""
    from harness.scenarios import run_bridge_scenario

    res = {
        mode: run_bridge_scenario(mode, _schedule(), loop=LOOP, eval_only=True, run_test=True)[0]
        for mode in ("reference", "mxfp8", "plugin")
    }
    ref = res["reference"].eval_losses
    assert not _close(res["mxfp8"].eval_losses[0], ref[0]), (
        "plugin off: the first eval forward's pre-hook gathers the never-staged shared buffer over the "
        "loaded weights; expected a wrong loss"
    )
    assert all(_close(res["plugin"].eval_losses[k], ref[k]) for k in ref), (res["plugin"].eval_losses, ref)


def test_loop_api_is_passive_with_a_loop_that_stages() -> None:
    """Issue 20: megatron-core >= 0.19 (writes forced gathers back, resets the dispatch state,
    ``prepare_model_params_for_param_sync``) with a loop that stages before every forced sync
    (Bridge 0.6 / Megatron-LM core_v0.19 helpers): every ``mxfp8_param_sync`` call, evals between
    saves, the final save, the closing sync and a test eval, issues no collective, stages nothing
    and writes no byte (measured outside the plugin: harness.bridge_real.costs)."""
    from harness.bridge_loop import run_api_with_staging_loop

    from mbridge_mxfp8_plugin.probes import probe_core

    if not probe_core().has_prepare_for_param_sync:
        pytest.skip("megatron-core < 0.19 has no prepare_model_params_for_param_sync: the loop cannot stage")
    for rank, out in enumerate(run_api_with_staging_loop()):
        assert out["passive"], rank
        costs = out["costs"]
        assert {"step_started", "before_eval", "after_eval", "before_save", "close"} <= {
            c.event for c in costs
        }
        busy = [(c.event, c.step, c.all_gathers, c.stagings, c.writes[:3]) for c in costs if not c.idle]
        assert not busy, (rank, busy)
