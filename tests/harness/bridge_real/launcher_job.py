"""One rank of the launcher proof: a shipped recipe YAML through ``mbridge_mxfp8_plugin.launch``.

The CPU-only pieces live here, not in the launcher: Bridge on CPU (``bridge_on_cpu``), emulated
MXFP8 params, the TE-2 dequantize patch, and :func:`tiny_gpt_config`, the recipe function the
launcher is pointed at (``--recipe harness.bridge_real.launcher_job:tiny_gpt_config``): the real-tier
tiny GPT with its MXFP8 knobs *off* (the YAML switches them on) and the pre-wrap hook that makes
the attention / MLP weights emulated MXFP8 params (what a TE fp8 model init does on GPUs).

Three runs in one process (``pretrain()`` tears down its global state; see ``worker.run_rank``):
``direct`` is the same job built in Python with ``MXFP8ParamSyncCallback(...)`` passed by hand;
``launcher`` and ``launcher_off`` go through ``launch.main`` with the YAML, the latter with the
override ``mxfp8_plugin.enabled=false``. ``finetune`` asks for ``--mode finetune`` (no training:
the launcher answers before building the job).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.bridge_real.config import JobSpec, build_config
from harness.bridge_real.worker import RankResult, _dequantize_like_te2, _Recorder, _to_mxfp8

RECIPE = "harness.bridge_real.launcher_job:tiny_gpt_config"


def tiny_gpt_config() -> Any:
    """The recipe function: the real tier's tiny GPT, MXFP8 knobs off, emulated MXFP8 weights.

    Like Bridge's own recipe functions it needs no process group (``--dry-run`` runs in one
    plain process): the world size is the group's when there is one, else torchrun's ``WORLD_SIZE``.
    """
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "2"))
    cfg = build_config(JobSpec(mode="reference"), world)
    cfg.model.register_pre_wrap_hook(lambda model: _to_mxfp8(model, []))
    return cfg


def _mxfp8_mixed_precision_without_te() -> contextlib.AbstractContextManager[None]:
    """Bridge's ``MixedPrecisionConfig.setup`` as it is, except that the model is not asked for
    Transformer Engine's fp8 (``fp8``, ``fp8_param``: TE autocast and fp8 model init, absent on
    CPU). The emulated MXFP8 params of the pre-wrap hook stand in for TE's fp8 model init; the
    ddp and optimizer knobs (fp8 param gather, grad-buffer reuse) are set exactly as on GPUs."""
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    from harness.bridge_cpu import patched

    setup = MixedPrecisionConfig.setup

    def cpu_setup(self: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
        setup(self, model_config, *args, **kwargs)
        model_config.fp8 = None
        model_config.fp8_param = False

    return patched([(MixedPrecisionConfig, "setup", cpu_setup)])


@dataclass
class LauncherRun:
    result: RankResult
    #: the launcher's exit status (None for the direct run)
    rc: int | None = None
    #: what the plugin and the launcher printed on stderr (this rank)
    log: str = ""
    #: ddp / optimizer MXFP8 knobs of the config pretrain() ran with
    knobs: dict[str, Any] = field(default_factory=dict)


_KNOBS = (
    ("ddp", "fp8_param_gather"),
    ("ddp", "reuse_grad_buf_for_mxfp8_param_ag"),
    ("ddp", "overlap_param_gather"),
    ("optimizer", "reuse_grad_buf_for_mxfp8_param_ag"),
    ("optimizer", "fp8_recipe"),
    ("optimizer", "overlap_param_gather"),
    ("model", "fp8_recipe"),
    ("train", "train_iters"),
    ("train", "global_batch_size"),
)


class _KnobProbe:
    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out

    def on_train_start(self, ctx: Any) -> None:
        cfg = ctx.state.cfg
        for section, key in _KNOBS:
            self.out[f"{section}.{key}"] = getattr(getattr(cfg, section), key)


@contextlib.contextmanager
def captured_fd(fd: int, out: list[str]) -> Iterator[None]:
    """What this process writes on file descriptor ``fd`` (1 or 2) while the block runs, whichever
    Python object or handler writes it; appended to ``out`` at the end."""
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def _stderr_and_fresh_plugin_logger(out: list[str]) -> Iterator[None]:
    """Capture file descriptor 2, whichever handler writes there (the one the launcher installs,
    or a root handler: Bridge's mixed-precision setup calls ``logging.debug``, which runs
    ``basicConfig`` on an unconfigured root). Afterwards put the plugin's logger back as a fresh
    process has it, so each run installs its own."""
    plugin_logger = logging.getLogger("mbridge_mxfp8_plugin")
    try:
        with captured_fd(2, out):
            yield
    finally:
        for handler in list(plugin_logger.handlers):
            plugin_logger.removeHandler(handler)
        plugin_logger.setLevel(logging.NOTSET)
        plugin_logger.propagate = True


def run_rank(yaml_path: str) -> dict[str, LauncherRun]:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from harness.bridge_cpu import bridge_on_cpu
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    with bridge_on_cpu(), emulated_mxfp8(), _dequantize_like_te2(), _mxfp8_mixed_precision_without_te():
        return {
            "direct": _direct(yaml_path),
            "launcher": _launched(yaml_path, []),
            "launcher_off": _launched(yaml_path, ["mxfp8_plugin.enabled=false"]),
            # refused before any config is built (Bridge 0.3's finetune takes no callbacks)
            "finetune": _launched(yaml_path, ["--mode", "finetune"]),
        }


def _direct(yaml_path: str) -> LauncherRun:
    """The job a user writes by hand: the same recipe function, MXFP8 knobs set in Python."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.adapters.recipes import load_recipe

    run = LauncherRun(RankResult())
    cfg = build_config(JobSpec(mode="plugin"), torch.distributed.get_world_size())
    cfg.mixed_precision = "bf16_with_mxfp8_mixed"  # as the YAML says
    cfg.model.register_pre_wrap_hook(lambda model: _to_mxfp8(model, run.result.mxfp8_param_names))
    options = load_recipe(yaml_path)[1]
    began = time.monotonic()
    pretrain(
        cfg,
        forward_step,
        callbacks=[MXFP8ParamSyncCallback(options), _KnobProbe(run.knobs), _Recorder(run.result, False)],
    )
    run.result.wall_s = time.monotonic() - began
    return run


def _launched(yaml_path: str, extra: list[str]) -> LauncherRun:
    from mbridge_mxfp8_plugin.commands.launch import main

    run = LauncherRun(RankResult())
    captured: list[str] = []
    began = time.monotonic()
    with _stderr_and_fresh_plugin_logger(captured):
        try:
            run.rc = main(
                ["--recipe", RECIPE, "--config-file", yaml_path, *extra],
                callbacks=[_KnobProbe(run.knobs), _Recorder(run.result, False)],
            )
        except Exception as exc:  # noqa: BLE001 - reported to the test, which expects rc 0 or 2
            run.rc = -1
            print(f"raised {exc!r}", file=sys.stderr)
    run.result.wall_s = time.monotonic() - began
    run.log = captured[0]
    return run
