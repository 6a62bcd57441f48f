"""``ensure_weights_current`` (engine/ensure.py) on real megatron-core over 2 gloo ranks: stale weights
after an unannounced step are made current with one gather per group, and a call that finds them
current (after its own refresh, or after an adapter's) gathers nothing. Cases: harness.verify_cases."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


@pytest.fixture(scope="module")
def runs(verify_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records of harness.verify_cases (one launch per session: tests/ranks/conftest.py)."""
    return verify_runs


def test_stale_after_step_then_ensure(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        stale = r["stale"]
        # Stale alike on both replicas: only the shard check can see it.
        assert not stale.ok and stale.shard_mismatch_count > 0 and stale.replica_mismatch_count == 0
        assert "after optimizer step" in stale.message()
        stats, gathers, after = r["ensure1"]
        assert gathers > 0 and stats.all_gathers > 0
        assert after.ok, after.message()
        stats, gathers, again = r["ensure2"]
        assert gathers == 0 and stats.all_gathers == 0 and stats.params_written == 0, stats
        assert again.ok
        assert not r["stale_again"].ok
        stats, gathers, after = r["ensure3"]
        assert gathers > 0 and after.ok, after.message()
        # After the engine's eval refresh (which gathered), nothing more to gather.
        assert r["eval_gathers"] > 0
        stats, gathers, after = r["ensure4"]
        assert gathers == 0 and stats.all_gathers == 0 and stats.params_written == 0, stats
        assert after.ok, after.message()
