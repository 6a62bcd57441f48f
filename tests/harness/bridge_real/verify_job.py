"""One rank of the weight-check proof: ``mxfp8_plugin.verify_weights`` on Megatron-Bridge's real
``pretrain()``, launched through ``mbridge_mxfp8_plugin.launch`` (tests/bridge_real/test_verify_real.py).

Two spies, both class-level patches undone after each run, record what happened:

* ``CallbackManager.fire`` notes every Bridge event (not the per-step ones) with the loop's
  ``train_state.step`` when it fires, before any callback runs: what the test counts the checks
  against is Bridge's own schedule, not the plugin's idea of it;
* ``Session.verify`` (the Bridge callback's session) notes each check the plugin asks for
  (``when`` true) with the
  event firing at that moment and the :class:`WeightReport` it made (the one it raised on too:
  ``last_report`` is set before ``raise_if_bad``), or None where no check ran.

A :class:`Corruption` makes one 32-element row block of one MXFP8 weight wrong on one rank inside
the plugin's hook, after the plugin has handled the event (its gathers, if any, have landed) and
right before its check: what the eval is about to compute with. The block's E8M0 scale is one
step too high (the values doubled; for the TE-shaped kind its scale byte incremented): a well-formed
MXFP8 block that is not the quantized main param. ``owned`` puts it inside the rank's own slice of
the param (the shard check sees it there, the replica check on every rank), else in a block a peer
owns (only the replica check can see it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.bridge_real.launcher_job import (
    RECIPE,
    _mxfp8_mixed_precision_without_te,
    _stderr_and_fresh_plugin_logger,
    captured_fd,
)
from harness.bridge_real.worker import RankResult, _dequantize_like_te2, _Recorder

BLOCK = 32


@dataclass
class Corruption:
    """Where to corrupt (set by the test) and what was corrupted (set on the rank that did)."""

    event: str = "on_eval_start"
    step: int = 3
    rank: int = 1
    owned: bool = True
    #: the param's name as the check names it, and the block's first element in the flat param
    param: str = ""
    block: int = -1
    #: the rank's owned slice of that param (flat elements, end exclusive)
    owned_range: tuple[int, int] = (0, 0)


@dataclass
class Check:
    """One check the plugin asked for."""

    #: the Bridge event firing when it ran (None: outside any callback) and the loop's step then
    fired: str | None
    step: int | None
    #: the event name the plugin gave the check
    event: str
    report: Any = None
    #: what the check raised (strict), ``Type: message``
    error: str = ""


@dataclass
class VerifyRun:
    argv: list[str]
    #: main's exit status; None when main raised (``raised`` says what)
    rc: int | None = None
    raised: str = ""
    raised_plugin_error: bool = False
    #: what the plugin and the launcher printed on stderr (this rank)
    log: str = ""
    #: (event, step) of every Bridge callback event but the per-step ones, in order
    fired: list[tuple[str, int | None]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    corruption: Corruption | None = None
    result: RankResult = field(default_factory=RankResult)
    #: Bridge's save hook exists in this release (``on_checkpoint_save``, Bridge >= 0.5)
    has_save_hook: bool = False
    #: the checkpoint iterations on disk after the run (when it saved)
    saved: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def run_rank(jobs: list[tuple[list[str], Corruption | None, str | None]]) -> list[VerifyRun]:
    """``jobs``: (launcher argv, corruption or None, checkpoint dir to list afterwards), run one
    after the other in this rank (``pretrain()`` tears its global state down after each). A job
    whose check raises leaves megatron-core's state behind: it must be the last."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from harness.bridge_cpu import bridge_on_cpu
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    out: list[VerifyRun] = []
    with bridge_on_cpu(), emulated_mxfp8(), _dequantize_like_te2(), _mxfp8_mixed_precision_without_te():
        for argv, corruption, save_dir in jobs:
            out.append(_launched(argv, corruption, save_dir))
            if out[-1].raised:
                break
    return out


def _launched(argv: list[str], corruption: Corruption | None, save_dir: str | None) -> VerifyRun:
    from megatron.bridge.training.callbacks import VALID_EVENTS

    from mbridge_mxfp8_plugin.commands.launch import main
    from mbridge_mxfp8_plugin.errors import MXFP8PluginError

    run = VerifyRun(["--recipe", RECIPE, *argv], corruption=corruption)
    run.has_save_hook = "on_checkpoint_save" in VALID_EVENTS
    captured: list[str] = []
    stdout: list[str] = []
    began = time.monotonic()
    # Bridge >= 0.5 configures logging onto stdout, where the plugin's lines then go: both count.
    with captured_fd(1, stdout), _stderr_and_fresh_plugin_logger(captured), _spying(run):
        try:
            run.rc = main(run.argv, callbacks=[_Recorder(run.result, False)])
        except Exception as exc:  # noqa: BLE001 - the strict check's error is what the test asserts
            run.raised = f"{type(exc).__name__}: {exc}"
            run.raised_plugin_error = isinstance(exc, MXFP8PluginError)
            print(f"raised {run.raised}", file=sys.stderr)
    run.wall_s = time.monotonic() - began
    run.log = captured[0] + stdout[0]
    if save_dir is not None:
        run.saved = sorted(int(p.name.removeprefix("iter_")) for p in Path(save_dir).glob("iter_*"))
    return run


@contextlib.contextmanager
def _spying(run: VerifyRun) -> Iterator[None]:
    from megatron.bridge.training.callbacks import CallbackManager

    from mbridge_mxfp8_plugin.adapters.session import Session

    fire, verify = CallbackManager.fire, Session.verify
    firing: list[tuple[str, int | None]] = []
    rank = torch.distributed.get_rank()

    def spied_fire(self: Any, event_name: str, context: Any) -> None:
        step = getattr(getattr(getattr(context, "state", None), "train_state", None), "step", None)
        if "_step_" not in event_name:
            run.fired.append((event_name, step))
        firing.append((event_name, step))
        try:
            fire(self, event_name, context)
        finally:
            firing.pop()

    def spied_verify(self: Any, event: str, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("when", True):
            return verify(self, event, *args, **kwargs)  # only remembers the model (a fresh job's load)
        fired, step = firing[-1] if firing else (None, None)
        c = run.corruption
        if c is not None and c.block < 0 and (fired, step) == (c.event, c.step) and rank == c.rank:
            _corrupt(self, c)
        check = Check(fired, step, event)
        run.checks.append(check)
        before = self.last_report
        try:
            check.report = verify(self, event, *args, **kwargs)
        except Exception as exc:
            check.error = f"{type(exc).__name__}: {exc}"
            check.report = self.last_report if self.last_report is not before else None
            raise
        return check.report

    CallbackManager.fire = spied_fire  # type: ignore[method-assign]
    Session.verify = spied_verify  # type: ignore[method-assign]
    try:
        yield
    finally:
        CallbackManager.fire = fire  # type: ignore[method-assign]
        Session.verify = verify  # type: ignore[method-assign]


def _corrupt(session: Any, c: Corruption) -> None:
    """Corrupt the first MXFP8 weight (model order) with a whole block where ``c`` asks for it."""
    from megatron.core import fp8_utils

    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers, main_shards

    engine = session.engine
    chunks = engine.model_chunks if engine is not None else session.verify_chunks
    opt = (engine.optimizer if engine is not None else None) or session.verify_optimizer
    shards = [s for o in distributed_optimizers(opt) for s in main_shards(o)]
    owned = {s.param: (s.param_start, s.param_end) for s in shards}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not fp8_utils.is_mxfp8tensor(p):
                continue
            start, end = owned.get(p, (0, 0))
            block = _pick_block(p.numel(), start, end, c.owned)
            if block is None:
                continue
            _scale_block_up(p, block)
            c.param = (f"{i}." if len(chunks) > 1 else "") + name
            c.block, c.owned_range = block, (start, end)
            return
    raise AssertionError(f"no MXFP8 weight has a block for {c}")


def _pick_block(numel: int, start: int, end: int, owned: bool) -> int | None:
    """The first whole 32-element block inside [start, end) (``owned``), else wholly outside it."""
    if owned:
        first = -(-start // BLOCK) * BLOCK
        return first if first + BLOCK <= end else None
    if start >= BLOCK:
        return 0
    after = -(-end // BLOCK) * BLOCK
    return after if after + BLOCK <= numel else None


def _scale_block_up(p: Any, block: int) -> None:
    """One E8M0 scale step up for the row block at flat element ``block`` (values doubled)."""
    cols = p.shape[-1]
    row, col = divmod(block, cols)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        scales = getattr(p, "_rowwise_scale_inv", None)
        if scales is not None:  # the TE-shaped kind: codes and E8M0 bytes
            assert int(scales[row, col // BLOCK]) < 254, "scale byte at its top"
            scales[row, col // BLOCK] += 1
        else:  # the value-holding kind: bf16 values, doubled exactly
            flat = torch.Tensor.view(p.detach(), -1)
            assert bool(flat[block : block + BLOCK].ne(0).any()), "an all-zero block stays equal"
            flat[block : block + BLOCK] *= 2
