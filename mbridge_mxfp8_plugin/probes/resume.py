"""Who re-derives the quantized params from the fp32 main params after a checkpoint load (F).

Two upstream answers exist, each found here by what the installed code does, never by version:

* the loop keeps the forward pre-hooks on for the first step after an MXFP8 resume, so that
  step stages the main params and its first forward gathers them through the params' own copy
  (Megatron-Bridge's ``train()`` since #5066: the initial ``disable_forward_pre_hook(model,
  param_sync=False)`` is skipped when the start iteration is past 0 and the recipe is MXFP8);
* the checkpoint loader re-derives the params itself (Megatron-LM #6666, on main after
  core_v0.19: ``refresh_model_params_from_main_params`` after the load).

:func:`probe_resume_files` reads them as text for ``doctor``; :func:`loop_rederives_after_load`
asks the loaded modules at run time. The runtime's own decision also reads the live pre-hook
state at the first step (:mod:`mbridge_mxfp8_plugin.engine.resume`); these probes only say more.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ._source import block, megatron_subdir, module_file, read_text

__all__ = ["REFRESH_AFTER_LOAD", "ResumeBehaviour", "loop_rederives_after_load", "probe_resume_files"]

#: The name of Megatron-LM's re-derivation after a load (#6666).
REFRESH_AFTER_LOAD = "refresh_model_params_from_main_params"

#: Modules that load checkpoints for a loop, by loop: Megatron-LM's, then Bridge's.
_LOADERS = ("megatron.training.checkpointing", "megatron.bridge.training.checkpointing")


@dataclass(frozen=True)
class ResumeBehaviour:
    """What the installed training loop does right after it loaded a checkpoint."""

    #: ``train()`` keeps the forward pre-hooks on for the first step of an MXFP8 resume (the
    #: step stages and gathers the main params); ``None``: no Bridge loop installed.
    keeps_prehooks_on_mxfp8_resume: bool | None
    #: a checkpoint loader re-derives the params from the main params after a load.
    loader_rederives: bool

    @property
    def loop_fixes_f(self) -> bool:
        return bool(self.keeps_prehooks_on_mxfp8_resume) or self.loader_rederives

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _keeps_prehooks_on_resume(train_py: str) -> bool:
    """The initial ``disable_forward_pre_hook(model, param_sync=False)`` of ``train()`` sits under a
    condition that reads the start iteration and the MXFP8 recipe (Bridge #5066's shape)."""
    train_fn = block(train_py, "def", "train")
    at = train_fn.find("disable_forward_pre_hook(model, param_sync=False)")
    if at < 0:
        return False
    before = train_fn[max(0, at - 1200) : at]
    return bool(re.search(r"start_iteration\s*>\s*0", before)) and "mxfp8" in before.lower()


def probe_resume_files(training_dir: str | Path | None = None) -> ResumeBehaviour:
    """Read the installed Bridge ``training/train.py`` and the checkpoint loaders as text."""
    root = Path(training_dir) if training_dir else megatron_subdir("bridge/training", "train.py")
    keeps = None if root is None else _keeps_prehooks_on_resume(read_text(root, "train.py"))
    loaders = [module_file(m) for m in _LOADERS]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in loaders if f is not None]
    return ResumeBehaviour(keeps, any(REFRESH_AFTER_LOAD in t for t in texts))


def loop_rederives_after_load() -> bool:
    """A loaded checkpoint loader re-derives the params after a load (Megatron-LM #6666)."""
    for name in _LOADERS:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        if callable(getattr(mod, REFRESH_AFTER_LOAD, None)):
            return True
        try:
            if REFRESH_AFTER_LOAD in inspect.getsource(mod):
                return True
        except (OSError, TypeError):
            continue
    return False
