"""The sampled check (verify/sampling.py: which blocks a check compares, one rotation) through
``verify_weights`` on real megatron-core over 2 gloo ranks: the sampled check is silent on current
weights, the full one covers every block, and a shifted slice or one bad block is found (by the full
check, and by the sample's rotation within its stride). Cases: harness.verify_cases."""

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
