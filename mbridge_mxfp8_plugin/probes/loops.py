"""What a training loop around megatron-core does at forced param syncs (defect B2's side).

The installed Megatron-Bridge is read as text (:func:`probe_bridge_files`: importing Bridge needs
Transformer Engine); a loop already running is asked through its loaded module
(:func:`probe_live_loop`), which imports nothing.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..common.records import record
from ._source import block, megatron_subdir, read_text

__all__ = ["BridgeLoopBehaviour", "bridge_training_dir", "probe_bridge_files", "probe_live_loop"]


@record
class BridgeLoopBehaviour:
    """What a Megatron-Bridge ``train()`` loop does around forced param syncs (from its source)."""

    source: str
    #: main params staged into the shared buffer before the eval's forced sync (B2 handled for
    #: evals): 0.5's explicit ``_copy_main_params_to_param_buffer`` or 0.6's optimizer-aware disable.
    stages_before_eval: bool
    #: staged before every forced sync: evals, saves, weight-hash checks, the closing disable (0.6+).
    stages_before_every_forced_sync: bool
    #: on_train_start fires before the initial ``disable_forward_pre_hook(param_sync=False)`` (0.4+).
    on_train_start_before_initial_disable: bool | None = None
    #: on_eval_start fires inside ``evaluate()`` after ``model.eval()`` (0.6+).
    on_eval_start_after_model_eval: bool | None = None
    #: ``on_checkpoint_save`` exists (0.5+); it fires after the save, never before.
    fires_on_checkpoint_save: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bridge_training_dir() -> Path | None:
    """``megatron/bridge/training`` of the installed Megatron-Bridge (found without importing it)."""
    return megatron_subdir("bridge/training", "train.py")


def probe_bridge_files(training_dir: str | Path | None = None) -> BridgeLoopBehaviour | None:
    """Read the installed Megatron-Bridge ``training/{train,eval,callbacks}.py`` as text.

    Never imports Bridge. Returns None when no Bridge is installed.
    """
    root = Path(training_dir) if training_dir else bridge_training_dir()
    if root is None or not (root / "train.py").is_file():
        return None
    train_py, eval_py, cb_py = (read_text(root, f) for f in ("train.py", "eval.py", "callbacks.py"))
    train_fn = block(train_py, "def", "train")
    prepare = "prepare_model_params_for_param_sync"
    optimizer_disable = prepare in block(train_py, "def", "disable_forward_pre_hook")
    optimizer_force = prepare in block(train_py, "def", "force_param_sync")
    saves_stage = bool(re.search(r"force_param_sync\(\s*model\s*,\s*optimizer", train_py))
    eval_disable_stages = optimizer_disable and bool(
        re.search(r"disable_forward_pre_hook\(\s*model\s*,\s*optimizer", train_fn)
    )
    ots = train_fn.find('"on_train_start"')
    first_disable = train_fn.find("disable_forward_pre_hook(model, param_sync=False)")
    eval_body = block(eval_py, "def", "evaluate")
    fired = re.search(r"fire\(\s*start_event\b", eval_body)
    start_at = fired.start() if fired else -1
    eval_at = eval_body.find(".eval()")
    return BridgeLoopBehaviour(
        source=str(root),
        stages_before_eval="_copy_main_params_to_param_buffer" in train_fn or eval_disable_stages,
        stages_before_every_forced_sync=(
            optimizer_disable and optimizer_force and saves_stage and eval_disable_stages
        ),
        on_train_start_before_initial_disable=(
            (ots < first_disable) if ots >= 0 and first_disable >= 0 else None
        ),
        on_eval_start_after_model_eval=(start_at > eval_at >= 0) if eval_body else None,
        fires_on_checkpoint_save=('"on_checkpoint_save"' in cb_py) if cb_py else None,
    )


#: Bridge's loop, and Megatron-LM's own (``pretrain_gpt.py`` -> ``megatron.training.training.train``).
_LOOP_MODULES = ("megatron.bridge.training.train", "megatron.training.training")


def _module_stages_before_forced_syncs(name: str) -> bool | None:
    """Whether the loaded loop module ``name`` hands the optimizer to its forced-sync helpers.

    Megatron-Bridge >= 0.6 and Megatron-LM core_v0.19 give ``force_param_sync`` and
    ``disable_forward_pre_hook`` an ``optimizer`` argument and call
    ``optimizer.prepare_model_params_for_param_sync()`` before the forced all-gather (Megatron-LM
    core_v0.19.0 training.py L3014-3024). None when the module is not loaded.
    """
    mod = sys.modules.get(name)
    if mod is None:
        return None
    try:
        params = [
            inspect.signature(getattr(mod, helper)).parameters
            for helper in ("force_param_sync", "disable_forward_pre_hook")
        ]
    except (AttributeError, TypeError, ValueError):
        return None
    return all("optimizer" in p for p in params)


def probe_live_loop() -> bool | None:
    """Does a loaded training loop (Megatron-Bridge's or Megatron-LM's) stage before every forced
    sync itself? True if either does, False if one is loaded and does not, None if neither is."""
    answers = [_module_stages_before_forced_syncs(name) for name in _LOOP_MODULES]
    if any(a is True for a in answers):
        return True
    return False if any(a is False for a in answers) else None
