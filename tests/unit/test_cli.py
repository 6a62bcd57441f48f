"""The console script's promises, in real processes: a bad argument, a closed pipe or a missing
dependency is one line on stderr and never a traceback, and the exit code means the same for every
subcommand: 0 ok, 1 problems found, 2 could not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from harness.console import COULD_NOT_RUN, TINY
from harness.console import cli as _cli
from harness.console import one_line_failure as _one_line_failure
from harness.mx_cases import ROOT
from packaging.version import Version


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    name, version = proc.stdout.strip().split(" ")
    assert name == "mxfp8-plugin"
    Version(version)  # PEP 440; test_install checks it equals the built wheel's METADATA


def test_demo_needs_an_eval_with_a_step_after_it():
    _one_line_failure(
        _cli("demo", "--train-iters", "3", "--eval-interval", "3"),
        COULD_NOT_RUN,
        "--eval-interval 3",
        "--train-iters 3",
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ((), ("required",)),
        (("bogus",), ("invalid choice", "bogus")),
        (("check",), ("recipe",)),
        (("check", TINY, "--dp-size", "0"), ("--dp-size", "0")),
        (("check", TINY, "garbage"), ("'garbage'", "key=value")),
        (("doctor", "--no-such-flag"), ("--no-such-flag",)),
    ],
    ids=["no-command", "unknown-command", "check-no-recipe", "dp-size-0", "not-an-override", "unknown-flag"],
)
def test_bad_arguments_are_one_line(args: tuple[str, ...], needles: tuple[str, ...]):
    _one_line_failure(_cli(*args), COULD_NOT_RUN, *needles)


def test_check_takes_overrides_after_options():
    """``check FILE --dp-size 8 key=value`` means what ``check FILE key=value --dp-size 8`` means."""
    before = _cli("check", TINY, "ddp.overlap_grad_reduce=false", "--dp-size", "8")
    after = _cli("check", TINY, "--dp-size", "8", "ddp.overlap_grad_reduce=false")
    plain = _cli("check", TINY, "--dp-size", "8")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert before.returncode == 1, before.stdout + before.stderr  # the override reached the rules
    assert (after.returncode, after.stdout, after.stderr) == (before.returncode, before.stdout, before.stderr)


def test_doctor_survives_a_closed_pipe():
    """``doctor --json | head -1``, and the harder case: the reader is gone before the first write."""
    piped = subprocess.run(
        f"{sys.executable} -m mbridge_mxfp8_plugin.commands.cli doctor --json | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert piped.stdout == "{\n" and piped.stderr == "", piped.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = _cli("doctor", "--json", stdout=write_end, stderr=subprocess.PIPE, capture_output=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and proc.stderr == "", proc.stderr
    assert proc.returncode == 0  # the report was made; only its reader left


def test_doctor_without_megatron_core_could_not_run():
    _one_line_failure(_cli("doctor", isolated=True), COULD_NOT_RUN, "megatron-core is not installed")
    proc = _cli("doctor", "--json", isolated=True)
    _one_line_failure(proc, COULD_NOT_RUN, "megatron-core")
    assert '"error"' in proc.stdout


_REST = re.compile(r":[a-z]+:`|``")


@pytest.mark.parametrize("command", [None, "check", "doctor", "demo"])
def test_help_is_plain_text(command: str | None):
    proc = _cli(*([command] if command else []), "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "usage: mxfp8-plugin" in proc.stdout
    assert not _REST.findall(proc.stdout), proc.stdout


def test_an_unexpected_error_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A failing rank's error arrives carrying that rank's traceback text; the user sees its headline
    and the error, on one line (MXFP8_PLUGIN_TRACEBACK=1 shows the rest)."""
    from mbridge_mxfp8_plugin.commands import cli, demo

    rank_error = (
        'rank 1 failed:\nTraceback (most recent call last):\n  File "toy.py", line 3, in step\n'
        "    loss.backward()\nRuntimeError: gloo connection reset"
    )

    def fail(**_: object) -> int:
        raise RuntimeError(rank_error)

    monkeypatch.delenv("MXFP8_PLUGIN_TRACEBACK", raising=False)
    monkeypatch.setattr(demo, "run_demo", fail)
    assert cli.main(["demo"]) == COULD_NOT_RUN
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "rank 1 failed" in err and "gloo connection reset" in err
    monkeypatch.setenv("MXFP8_PLUGIN_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="gloo connection reset"):
        cli.main(["demo"])


_LEAVE = """
import atexit, sys, threading, time
from mbridge_mxfp8_plugin.commands.cli import leave

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()
print("x" * 200_000)  # more than a pipe's buffer: all of it must reach the reader
if "atexit" in sys.argv:
    atexit.register(print, "atexit ran")
if "thread" in sys.argv:
    threading.Thread(target=time.sleep, args=(0.2,)).start()
leave(3)
"""


@pytest.mark.parametrize("waiting", [None, "atexit", "thread"])
def test_leave_skips_teardown_only_when_nothing_waits_for_it(waiting: str | None):
    """check's process ends without the interpreter's module teardown (issue 30's speed), yet its
    output is flushed, an atexit handler (coverage, logging) still runs and a live thread still
    gets the usual exit, which waits for it."""
    proc = subprocess.run(
        [sys.executable, "-c", _LEAVE, *([waiting] if waiting else [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "x" * 200_000
    ran = set(lines[1:])
    if waiting == "thread":
        assert "teardown ran" in ran, "a live thread was cut off by a fast exit"
    else:
        assert "teardown ran" not in ran, "the interpreter tore its modules down: no fast exit"
    assert ("atexit ran" in ran) == (waiting == "atexit"), "an atexit handler was skipped"


def test_console_script_exits_fast_with_its_verdict():
    """The console script (``python -m``) ends ``check`` through ``leave``: its exit code is the
    verdict, its output complete, and no module teardown runs (a module-level finalizer would
    print), also with overrides, whose Hydra import registers logging's atexit handler."""
    code = (
        "import runpy, sys\n"
        "class T:\n    def __del__(self): print('teardown ran', flush=True)\n"
        "sys.modules['__teardown_probe__'] = type(sys)('p'); sys.modules['__teardown_probe__'].t = T()\n"
        "sys.argv = ['mxfp8-plugin', 'check', '--json', 'recipes/llama3_8b_mxfp8_pretrain.yaml',"
        " 'optimizer.overlap_param_gather_with_optimizer_step=true']\n"
        "runpy.run_module('mbridge_mxfp8_plugin', run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "teardown ran" not in proc.stdout
    import json

    report = json.loads(proc.stdout)
    assert any(r["id"] == "MX007" and r["status"] == "fail" for r in report["rules"]), report
