"""One line for an import that failed (common/missing.py): a missing dependency or reader names the
package and how to install it, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness.console import COULD_NOT_RUN, TINY
from harness.console import cli as _cli
from harness.console import one_line_failure as _one_line_failure
from harness.mx_cases import ROOT


def test_missing_dependencies_are_one_line():
    _one_line_failure(_cli("demo", isolated=True), COULD_NOT_RUN, "'torch'", "pip install torch")
    _one_line_failure(_cli("check", TINY, isolated=True), COULD_NOT_RUN, "omegaconf")


@pytest.mark.parametrize("blocked, overrides", [("omegaconf", []), ("hydra", ["ddp.bucket_size=4e7"])])
def test_missing_reader_is_one_line_naming_the_fix(blocked, overrides):
    script = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from mbridge_mxfp8_plugin.commands.cli import main\n"
        f"sys.exit(main(['check', 'recipes/tiny_debug_mxfp8.yaml', *{overrides!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"({blocked} is not importable): pip install" in proc.stderr
