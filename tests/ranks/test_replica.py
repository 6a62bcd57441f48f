"""The verifier's replica check (verify/replica.py) on real megatron-core over 2 gloo ranks: one rank's
copy of a bias drifts where that rank holds no shard of it; the shard check cannot see it, the
replica check must, on every rank; a drifted scale byte alone is one; and a rank whose own shard is current
learns of a peer's mismatch through the all-reduce. Cases: harness.verify_cases, harness.verify_codes."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


@pytest.fixture(scope="module")
def runs(verify_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records of harness.verify_cases (one launch per session: tests/ranks/conftest.py)."""
    return verify_runs


def test_replica_disagreement(runs: list[dict[str, Any]]) -> None:
    name = runs[0]["replica_param"]
    for r in runs:
        rep = r["replica"]
        assert not rep.ok and rep.replica_mismatches == [name], rep.message()
    # Rank 0's own copy is untouched: it learns of the drift only through the all-reduce.
    assert runs[0]["replica"].shard_mismatch_count == 0
    with pytest.raises(Exception, match="perturbed.*replicas"):
        runs[0]["replica"].raise_if_bad()


def test_a_drifted_scale_byte_alone_is_a_replica_mismatch(runs: list[dict[str, Any]]) -> None:
    """Issue 32.5: the fold holds the E8M0 scale bytes, not the codes alone. Rank 1's copy of a
    TE-shaped weight (harness.verify_codes, in every pass) differs in one scale byte of a block
    rank 0 owns: no shard check sees it, every rank's replica check names the param."""
    name = runs[0]["codes"]["scale_name"]
    for r in runs:
        rep = r["codes"]["drift"]
        assert not rep.ok and rep.replica_mismatches == [name], rep.message()
        assert rep.shard_mismatch_count == 0 and rep.peer_mismatch_count == 0, rep.message()


def test_a_peers_shard_mismatch_reaches_a_rank_whose_own_shard_is_current(runs: list[dict[str, Any]]) -> None:
    """Issue 32.5: only rank 0's owned shard differs (its main shard moved, the replicas alike),
    so the replica check cannot see it: rank 1 learns of it only from the count the all-reduce
    carries, and its report is WRONG too, with the full check and the default sample."""
    for r in runs:
        assert r["peer"]["clean"].ok and r["peer"]["restored"].ok, r["peer"]["clean"].message()
    for event in ("full", "sampled"):
        mine, peer = runs[0]["peer"][event], runs[1]["peer"][event]
        assert mine.shard_mismatch_count > 0 and mine.replica_mismatch_count == 0, mine.message()
        assert peer.shard_mismatch_count == 0 and peer.replica_mismatch_count == 0, peer.message()
        assert peer.peer_mismatch_count == mine.shard_mismatch_count and not peer.ok, peer.message()
        assert "a data-parallel peer found" in peer.message()
        with pytest.raises(Exception, match="peer.*WRONG: a data-parallel peer"):
            peer.raise_if_bad()
