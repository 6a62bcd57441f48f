"""The sampled check (verify/sampling.py: which blocks a check compares, one rotation) through
``verify_weights`` on real megatron-core over 2 gloo ranks: the sampled check is silent on current
weights, the full one covers every block, and a shifted slice or one bad block is found (by the full
check, and by the sample's rotation within its stride), and a scale byte of the TE-shaped type on rows
of a multiple of 128 elements at the default stride. Cases: harness.verify_cases, harness.verify_codes."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


@pytest.fixture(scope="module")
def runs(verify_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records of harness.verify_cases (one launch per session: tests/ranks/conftest.py)."""
    return verify_runs


def test_sampled_check_silent_on_current_weights_and_full_covers_every_block(
    runs: list[dict[str, Any]],
) -> None:
    for r in runs:
        case = r["sampling"]
        clean, full = case["clean"], case["clean_full"]
        assert clean.ok and full.ok, (clean.message(), full.message())
        assert full.sample == 1.0 and clean.sample == 1 / case["stride"]
        # The full check compares every owned element but those of blocks split between ranks.
        assert full.elements_checked + full.elements_skipped == case["owned_elements"]
        assert 0 < clean.elements_checked < full.elements_checked / 4
        assert clean.params_checked == full.params_checked


def test_sampled_check_fires_on_one_shifted_slice(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        case = r["sampling"]
        rep = case["shifted"]
        assert not rep.ok and [m.name for m in rep.shard_mismatches] == [case["aligned"]], rep.message()
        assert case["restored"].ok, case["restored"].message()


def test_one_bad_block_found_by_full_check_and_by_rotation(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        case = r["sampling"]
        full = case["one_block_full"]
        assert {m.name for m in full.shard_mismatches} == {case["aligned"], case["odd"]}, full.message()
        assert all(m.elements <= 32 for m in full.shard_mismatches)
        seen: dict[str, int] = {}
        for rep in case["one_block_sampled"]:
            for m in rep.shard_mismatches:
                seen[m.name] = seen.get(m.name, 0) + 1
        # Each bad block is visited within ``stride`` consecutive calls, and not by every call.
        assert set(seen) == {case["aligned"], case["odd"]}, seen
        assert all(0 < count < case["stride"] for count in seen.values()), seen


def test_a_scale_byte_on_rows_of_128k_elements_is_found_within_the_stride(runs: list[dict[str, Any]]) -> None:
    """Issue 32.5: rows of a multiple of 128 elements (scale rows without tile padding, the usual
    shape) at the default sample (stride 16): the sampled blocks' scales are read where they are.
    One scale byte of rank 0's slice (the kit's TE-shaped type, harness.verify_codes) is named by
    rank 0's full check with that block's elements only, and by some phases of the sample but not
    all; rank 1's report fails through the replica check."""
    name = runs[0]["codes"]["scale_name"]
    for rank, r in enumerate(runs):
        case = r["codes"]["scale"]
        full = case["full"]
        assert not full.ok and full.replica_mismatches == [name], full.message()
        named = [rep for rep in case["sampled"] if rep.shard_mismatch_count]
        if rank == 0:
            assert [m.name for m in full.shard_mismatches] == [name], full.message()
            assert 0 < full.shard_mismatches[0].elements <= 32, full.message()
            assert 0 < len(named) < len(case["sampled"]), [rep.message() for rep in case["sampled"]]
            for rep in named:
                assert [(m.name, m.elements) for m in rep.shard_mismatches] == [
                    (name, full.shard_mismatches[0].elements)
                ], rep.message()
        else:
            assert full.shard_mismatch_count == 0 and not named, full.message()
