"""The verifier's replica check (verify/replica.py) on real megatron-core over 2 gloo ranks: one rank's
copy of a bias drifts where that rank holds no shard of it; the shard check cannot see it, the
replica check must, on every rank. Cases: harness.verify_cases."""

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
