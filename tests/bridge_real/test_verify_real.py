"""``mxfp8_plugin.verify_weights: true`` on Megatron-Bridge's real ``pretrain()`` (issue 32, item 6).

Four launcher runs (``mbridge_mxfp8_plugin.launch`` with the recipe function of
tests/bridge_real/test_launch.py) in one launch of 2 gloo ranks (harness/bridge_real/verify_job.py):

* ``ok``: a YAML written here, the shipped ``tiny_gpt_mxfp8_launch`` with ``verify_weights: true``
  and ``verify_sample: 1.0`` in its ``mxfp8_plugin:`` section, saving torch_dist checkpoints at 3
  and 6 (``checkpoint.save``, ``checkpoint.save_interval=3``): 6 steps, evals at 3 and 6, then
  pretrain's final validation and test. Every check the plugin makes is matched against the events
  Bridge fired (a spy on ``CallbackManager.fire``): one check at each eval start, test start,
  checkpoint save and train end, none at the train start of a fresh job, each OK on every rank.
  Bridge 0.3.1 has no save hook (``on_checkpoint_save`` came with 0.5): there the saves happen
  (asserted on disk) and are not checked; from 0.5 each save must bring its own OK check. At
  every check the two ranks' shard checks together compared every element of every param.
* ``resumed``: the YAML again, loading the ``ok`` run's step-3 checkpoint and training to 6: the
  check at its train start ("checkpoint load") and at each later event, all OK.
* ``logged``: the shipped file with the check switched on by overrides and ``strict=false``; at
  the eval at step 3, inside the plugin's hook after its eval-start handling and right before its
  check, rank 1 makes one 32-element block in its own slice of an MXFP8 weight wrong (its scale one
  step up). That check must be WRONG on both ranks and name the param: rank 1's shard check, the
  replica check on both, and rank 0's ERROR line. The job trains on; the next step's gather writes
  the block again from the main params, so every later check is OK.
* ``strict``: the YAML (``strict: true``), the same corruption in a block of rank 1's copy that
  rank 0 owns, where only the replica check can see it. Both ranks' checks raise
  ``MXFP8PluginError`` naming the param, and it leaves ``launch.main`` as that exception (main
  turns config refusals into exit 1, not a wrong weight: under torchrun the ranks exit non-zero
  with the verifier's message).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_gpt_mxfp8_launch.yaml"
SAVE_INTERVAL = 3
#: the Bridge events at which the plugin checks the weights of a fresh job (docs/verify.md's table)
CHECKED_AT = ("on_eval_start", "on_test_start", "on_checkpoint_save", "on_train_end")
RUNS = ("ok", "resumed", "logged", "strict")

_NEEDED = ("transformers", "modelopt", "omegaconf", "tensorboard", "psutil", "megatron.bridge")
_MISSING = [n for n in _NEEDED if importlib.util.find_spec(n.split(".")[0]) is None]
if _MISSING and os.environ.get("MXFP8_REAL_BRIDGE") == "require":
    raise RuntimeError(f"MXFP8_REAL_BRIDGE=require but {_MISSING} are not installed")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"real Bridge pretrain needs {_MISSING}")


def _with_verify(text: str) -> str:
    head = "mxfp8_plugin:\n"
    assert text.count(head) == 1, "the shipped recipe has one mxfp8_plugin section"
    return text.replace(head, head + "  verify_weights: true\n  verify_sample: 1.0\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from harness.bridge_real.verify_job import Corruption, run_rank

    from mbridge_mxfp8_plugin.testing.launcher import launch

    root = tmp_path_factory.mktemp("bridge_verify")
    recipe = root / "tiny_gpt_mxfp8_verify.yaml"
    recipe.write_text(_with_verify(RECIPE.read_text()))
    ckpt = root / "ckpt"
    on = ["mxfp8_plugin.verify_weights=true", "mxfp8_plugin.verify_sample=1.0"]
    file = ["--config-file", str(recipe)]
    jobs = [
        ([*file, f"checkpoint.save={ckpt}", f"checkpoint.save_interval={SAVE_INTERVAL}"], None, str(ckpt)),
        ([*file, f"checkpoint.load={ckpt}", f"checkpoint.ckpt_step={SAVE_INTERVAL}"], None, None),
        (["--config-file", str(RECIPE), *on, "mxfp8_plugin.strict=false"], Corruption(owned=True), None),
        (file, Corruption(owned=False), None),  # last: it raises
    ]
    timeout = float(os.environ.get("MXFP8_REAL_BRIDGE_TIMEOUT", "1500"))
    per_rank = launch(run_rank, 2, jobs, timeout=timeout)
    assert all(len(rank) == len(RUNS) for rank in per_rank), [len(r) for r in per_rank]
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(RUNS)}


def _fired(run, event: str) -> list[int | None]:
    return [s for e, s in run.fired if e == event]


def _expected(run) -> list[tuple[str, int | None]]:
    """The (event, step) of every check the plugin must make, in Bridge's order: each eval, test,
    save and train end, and the train start of a job that loaded a checkpoint (step > 0)."""
    return [(e, s) for e, s in run.fired if e in CHECKED_AT or (e == "on_train_start" and s)]


def _assert_one_check_per_event(run) -> None:
    """None missing, none extra, each named for its event."""
    assert [(c.fired, c.step) for c in run.checks] == _expected(run), (run.checks, run.fired)
    names = {"on_train_start": "checkpoint load"}
    assert [c.event for c in run.checks] == [names.get(e, e) for e, _ in _expected(run)]


def _at(run, fired: str, step: int):
    (check,) = [c for c in run.checks if (c.fired, c.step) == (fired, step)]
    return check


def _assert_ok(check) -> None:
    r = check.report
    assert r is not None and check.error == "", check
    assert r.ok and r.verdict == "ok", r.message()
    assert r.event == f"{check.event} (Bridge)", r.event
    assert r.unchecked == [] and r.mxfp8_unchecked == 0 and r.unchecked_types == [], r.unchecked
    assert r.mxfp8_checked > 0 and r.params_checked > 0 and r.sample == 1.0, r.message()
    assert r.groups_reduced == 1 and r.params_hashed > 0, r.message()


def _assert_every_element_compared(per_rank) -> None:
    """At each check the ranks' shard checks together compared every element of every param
    once (their owned slices tile the buffers; a block split between two slices is skipped), and
    both folded every param for the replica check."""
    layout = per_rank[0].result.layout
    assert layout and layout == per_rank[1].result.layout
    total = sum(math.prod(shape) for *_, shape in layout.values())
    for c0, c1 in zip(*(run.checks for run in per_rank), strict=True):
        a, b = c0.report, c1.report
        assert a.elements_checked + b.elements_checked + a.elements_skipped + b.elements_skipped == total
        assert a.params_hashed == b.params_hashed == len(layout), (a.params_hashed, len(layout))


def test_every_eval_test_save_and_train_end_is_checked_ok_on_every_rank(runs):
    for rank, run in enumerate(runs["ok"]):
        assert run.rc == 0 and not run.raised, (rank, run.raised, run.log[-2000:])
        assert sorted(run.result.train_losses) == list(range(1, 7))
        # Bridge's own schedule: the loop's evals at 3 and 6, pretrain's final validation and test
        assert _fired(run, "on_eval_start")[:2] == [3, 6], run.fired
        assert _fired(run, "on_test_start") == [6] and _fired(run, "on_train_end") == [6], run.fired
        assert _fired(run, "on_train_start") == [0], run.fired  # fresh: nothing loaded to check
        assert run.saved == [3, 6], run.saved
        saves = _fired(run, "on_checkpoint_save")
        if run.has_save_hook:  # Bridge >= 0.5: every save fires the hook, and is checked
            assert {3, 6} <= set(saves), run.fired
        else:  # Bridge 0.3 / 0.4: the saves happened (on disk) with nothing to hook a check on
            assert saves == [], run.fired
        _assert_one_check_per_event(run)
        assert len(run.checks) >= 5, run.checks
        if rank == 0:  # the plan and its capture were made at train start, not at the first eval
            assert run.log.count("weight check prepared at train start in") == 1, run.log[-3000:]
        for check in run.checks:
            _assert_ok(check)
    _assert_every_element_compared(runs["ok"])


def test_a_resume_is_checked_at_the_load_and_after(runs):
    """The run loads the ``ok`` run's step-3 checkpoint and trains to 6: the check at train start
    ("checkpoint load": the weights Bridge's load wrote through each param's ``copy_`` against
    the loaded main params), then each eval, the test and train end, all OK."""
    for rank, run in enumerate(runs["resumed"]):
        assert run.rc == 0 and not run.raised, (rank, run.raised, run.log[-2000:])
        assert sorted(run.result.train_losses) == [4, 5, 6]
        assert _fired(run, "on_train_start") == [SAVE_INTERVAL], run.fired
        _assert_one_check_per_event(run)
        assert run.checks[0].event == "checkpoint load" and len(run.checks) >= 5, run.checks
        for check in run.checks:
            _assert_ok(check)
    _assert_every_element_compared(runs["resumed"])


def _assert_names_corruption(report, c, *, shard: bool) -> None:
    """WRONG at this check, the corrupted param the only one named."""
    assert not report.ok and report.verdict == "wrong", report.message()
    assert report.replica_mismatches == [c.param] and report.replica_mismatch_count == 1, report.message()
    assert c.param in report.message(), report.message()
    if shard:
        assert [m.name for m in report.shard_mismatches] == [c.param], report.message()
        (m,) = report.shard_mismatches
        assert report.shard_mismatch_count == 1 and 1 <= m.elements <= 32 and m.max_abs_diff > 0, m
    else:
        assert report.shard_mismatch_count == 0 and report.shard_mismatches == [], report.message()


def test_a_corrupted_block_is_named_and_training_goes_on_with_strict_false(runs):
    r0, r1 = runs["logged"]
    c = r1.corruption
    assert c.param and c.block >= 0 and r0.corruption.block == -1  # rank 1 alone corrupted
    start, end = c.owned_range
    assert start <= c.block and c.block + 32 <= end, c  # inside rank 1's own slice
    for rank, run in enumerate((r0, r1)):
        assert run.rc == 0 and not run.raised, (rank, run.raised)
        assert sorted(run.result.train_losses) == list(range(1, 7))
        _assert_one_check_per_event(run)
        bad = _at(run, "on_eval_start", 3)
        assert bad.error == "" and bad.report is not None
        _assert_names_corruption(bad.report, c, shard=rank == 1)
        # rank 0's own slice is right, and it learns of rank 1's mismatch through the all-reduce
        assert bad.report.peer_mismatch_count == 1, bad.report.message()
        # the next step's gather rewrote the block from the main params: later checks are OK
        later = run.checks[run.checks.index(bad) + 1 :]
        assert len(later) >= 3, run.checks
        for check in later:
            _assert_ok(check)
    line = [ln for ln in r0.log.splitlines() if "MXFP8 weight check at on_eval_start (Bridge): WRONG" in ln]
    assert len(line) == 1 and c.param in line[0] and "strict=False: training goes on" in line[0], r0.log
    assert "WRONG" not in r1.log  # rank-zero logging


def test_a_corrupted_block_only_a_peer_owns_fails_the_strict_launch_naming_it(runs):
    r0, r1 = runs["strict"]
    c = r1.corruption
    assert c.param and c.block >= 0 and r0.corruption.block == -1
    start, end = c.owned_range
    assert c.block + 32 <= start or c.block >= end, c  # outside rank 1's own slice
    for rank, run in enumerate((r0, r1)):
        assert run.rc is None and run.raised_plugin_error, (rank, run.rc, run.raised)
        assert run.raised.startswith("MXFP8PluginError: MXFP8 weight check at on_eval_start (Bridge): WRONG")
        assert c.param in run.raised and "differ between data-parallel replicas" in run.raised, run.raised
        # the job stopped at that check: the first eval, after 3 steps
        assert sorted(run.result.train_losses) == [1, 2, 3]
        assert run.fired[-1] == ("on_eval_start", 3), run.fired
        bad = run.checks[-1]
        assert (bad.fired, bad.step) == ("on_eval_start", 3) and bad.error == run.raised, run.checks
        _assert_names_corruption(bad.report, c, shard=False)
        assert bad.report.peer_mismatch_count == 0  # no shard check failed anywhere
        assert all(not ch.error and ch.report.ok for ch in run.checks[:-1])
