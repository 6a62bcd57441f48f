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
import io
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.bridge_real.config import JobSpec, build_config
from harness.bridge_real.worker import RankResult, _dequantize_like_te2, _Recorder, _to_mxfp8

RECIPE = "harness.bridge_real.launcher_job:tiny_gpt_config"


def tiny_gpt_config() -> Any:
    """The recipe function: the real tier's tiny GPT, MXFP8 knobs off, emulated MXFP8 weights."""
    cfg = build_config(JobSpec(mode="reference"), torch.distributed.get_world_size())
    cfg.model.register_pre_wrap_hook(lambda model: _to_mxfp8(model, []))
    return cfg


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
def _stderr_and_fresh_plugin_logger(buf: io.StringIO) -> Any:
    """Capture stderr (the handler the launcher installs binds to it when created); afterwards
    put the plugin's logger back as a fresh process has it, so each run installs its own."""
    plugin_logger = logging.getLogger("mbridge_mxfp8_plugin")
    with contextlib.redirect_stderr(buf):
        try:
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

    with bridge_on_cpu(), emulated_mxfp8(), _dequantize_like_te2():
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
    from mbridge_mxfp8_plugin.recipes import load_recipe

    run = LauncherRun(RankResult())
    cfg = build_config(JobSpec(mode="plugin"), torch.distributed.get_world_size())
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
    from mbridge_mxfp8_plugin.launch import main

    run = LauncherRun(RankResult())
    buf = io.StringIO()
    began = time.monotonic()
    with _stderr_and_fresh_plugin_logger(buf):
        try:
            run.rc = main(
                ["--recipe", RECIPE, "--config-file", yaml_path, *extra],
                callbacks=[_KnobProbe(run.knobs), _Recorder(run.result, False)],
            )
        except Exception as exc:  # noqa: BLE001 - reported to the test, which expects rc 0 or 2
            run.rc = -1
            print(f"raised {exc!r}", file=sys.stderr)
    run.result.wall_s = time.monotonic() - began
    run.log = buf.getvalue()
    return run
