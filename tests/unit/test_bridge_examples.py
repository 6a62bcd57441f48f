"""Megatron-Bridge's own example override files, each checked against its own release's sources:
no false alarm. Runs only on files fetched locally (never committed: upstream files), laid out as

    $MXFP8_BRIDGE_EXAMPLES/<tag>/src/megatron/bridge/...      git archive <tag> src/megatron/bridge
    $MXFP8_BRIDGE_EXAMPLES/<tag>/examples/**/conf/*.yaml      git show <tag>:<path> > ...
    $MXFP8_BRIDGE_EXAMPLES/<tag>/tutorials/**/*.yaml

Each file is checked as written and with MXFP8 switched on (``++mixed_precision=
bf16_with_mxfp8_mixed``); exit 0 is expected, except for keys Bridge itself skips (``KNOWN``:
Bridge's ``apply_overrides`` logs "not found ... Skipping" and the value never reaches the job).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.mx_cases import ROOT

BASE = Path(os.environ.get("MXFP8_BRIDGE_EXAMPLES", "/nonexistent"))
#: file name -> the finding it must carry (an error Bridge's own merge would silently drop)
KNOWN = {"qwen3_next_80b_a3b_finetune_override_example.yaml": "error MX101 optimizer.finetune_lr:"}


def _cases() -> list[tuple[Path, Path]]:
    if not BASE.is_dir():
        return []
    out = []
    for tag in sorted(p for p in BASE.iterdir() if (p / "src" / "megatron" / "bridge").is_dir()):
        files = [*tag.glob("examples/**/conf/*.yaml"), *tag.glob("tutorials/**/*.yaml")]
        out += [(tag, f) for f in sorted(files)]
    return out


CASES = _cases()


@pytest.mark.skipif(not CASES, reason="set MXFP8_BRIDGE_EXAMPLES to fetched Bridge tags (see the docstring)")
@pytest.mark.parametrize("mxfp8", [False, True], ids=["as-written", "mxfp8-on"])
@pytest.mark.parametrize(("tag", "path"), CASES, ids=[f"{t.name}:{p.name}" for t, p in CASES])
def test_bridge_example_has_no_false_alarm(tag: Path, path: Path, mxfp8: bool):
    env = {**os.environ, "NO_VCS_VERSION": "1", "PYTHONPATH": str(tag / "src")}
    extra = ["++mixed_precision=bf16_with_mxfp8_mixed"] if mxfp8 else []
    proc = subprocess.run(
        [sys.executable, "-m", "mbridge_mxfp8_plugin.commands.cli", "check", str(path), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    if path.name in KNOWN:
        assert proc.returncode == 1 and KNOWN[path.name] in proc.stdout, proc.stdout
        errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error ")]
        assert len(errors) == 1, errors
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
