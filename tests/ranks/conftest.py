"""The ranks tier's shared launches: one per session for the tests of several files.

The verifier's and ``ensure_weights_current``'s cases (harness.verify_cases) run in ONE 2-rank
launch, whichever of their test files run (test_weights.py, test_sampling.py, test_replica.py,
test_ensure.py): the toy jobs are cheap, process start-up is not."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def verify_runs() -> list[dict[str, Any]]:
    """Per rank: each verifier case's record, the installed core's version and what it does by itself."""
    from harness.verify_cases import run_verify_cases

    return run_verify_cases()
