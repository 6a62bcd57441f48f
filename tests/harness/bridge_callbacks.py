"""Megatron-Bridge's real callbacks and the record that compares loops: the installed wheel's files
found without importing it, ``training/callbacks.py`` loaded by file path (it needs only the stdlib),
and :func:`recording_param_syncs`, which makes the replica (:mod:`.bridge_loop`) and Bridge's real
``train()`` log the same calls.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["find_bridge_file", "load_bridge_callbacks", "recording_param_syncs"]


@contextlib.contextmanager
def recording_param_syncs(events: list[str]) -> Iterator[list[str]]:
    """Append to ``events`` every pre-hook toggle, forced param sync and main-param staging.

    Instruments megatron-core's classes, not a loop, so the very same record comes out of this
    replica and of Bridge's real ``train()``: ``disable_pre_hooks`` / ``enable_pre_hooks``
    (``DistributedDataParallel.{disable,enable}_forward_pre_hook``), ``force_sync``
    (``start_param_sync(force_sync=True)``, also the one inside a disable) and ``stage``
    (``DistributedOptimizer._copy_main_params_to_param_buffer``, whoever calls it: the loop's
    per-step copy, Bridge 0.5's pre-eval staging, core 0.19's ``prepare_model_params_for_param_sync``
    or the plugin). Combined with a callback that logs its events, two loops that produce the same
    list made the same calls in the same order.
    """
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistOpt

    originals = {
        (DDP, "disable_forward_pre_hook"): DDP.disable_forward_pre_hook,
        (DDP, "enable_forward_pre_hook"): DDP.enable_forward_pre_hook,
        (DDP, "start_param_sync"): DDP.start_param_sync,
        (DistOpt, "_copy_main_params_to_param_buffer"): DistOpt._copy_main_params_to_param_buffer,
    }

    def disable(self: Any, *args: Any, **kwargs: Any) -> Any:
        param_sync = kwargs.get("param_sync", args[0] if args else True)
        events.append("disable_pre_hooks" if param_sync else "disable_pre_hooks(no_sync)")
        return originals[(DDP, "disable_forward_pre_hook")](self, *args, **kwargs)

    def enable(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("enable_pre_hooks")
        return originals[(DDP, "enable_forward_pre_hook")](self, *args, **kwargs)

    def start_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("force_sync", False):
            events.append("force_sync")
        return originals[(DDP, "start_param_sync")](self, *args, **kwargs)

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("stage")
        return originals[(DistOpt, "_copy_main_params_to_param_buffer")](self, *args, **kwargs)

    replacements = {
        (DDP, "disable_forward_pre_hook"): disable,
        (DDP, "enable_forward_pre_hook"): enable,
        (DDP, "start_param_sync"): start_param_sync,
        (DistOpt, "_copy_main_params_to_param_buffer"): stage,
    }
    for (cls, name), fn in replacements.items():
        setattr(cls, name, fn)
    try:
        yield events
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)


def find_bridge_file(relative: str = "training/callbacks.py") -> Path:
    """Locate a file of the installed megatron-bridge distribution without importing the package."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / "bridge" / relative
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"megatron/bridge/{relative} not found; install the wheel without its dependencies: "
        "pip install --no-deps megatron-bridge==0.3.1"
    )


def load_bridge_callbacks(path: str | Path | None = None) -> ModuleType:
    """Load ``megatron/bridge/training/callbacks.py`` by file path (it needs only the stdlib)."""
    file = Path(path) if path else find_bridge_file()
    name = "_bridge_callbacks_" + str(abs(hash(str(file))))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
