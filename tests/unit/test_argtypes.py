"""The console script's argument types (common/argtypes.py): a bad count is one line naming the flag,
the value and a value that works, before anything starts."""

from __future__ import annotations

import pytest
from harness.console import COULD_NOT_RUN
from harness.console import cli as _cli
from harness.console import one_line_failure as _one_line_failure


@pytest.mark.parametrize(
    ("flag", "value", "fix"),
    [
        ("--eval-interval", "0", "--eval-interval 3"),
        ("--world-size", "0", "--world-size 2"),
        ("--train-iters", "-1", "--train-iters 9"),
        ("--world-size", "two", "--world-size 2"),
    ],
)
def test_demo_rejects_bad_counts_before_starting(flag: str, value: str, fix: str):
    line = _one_line_failure(_cli("demo", flag, value), COULD_NOT_RUN, flag, value, fix)
    assert line.startswith("mxfp8-plugin demo: error:")
