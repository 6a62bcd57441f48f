"""What the installed megatron-core / Megatron-Bridge do, as far as a config check needs to know.

A config can be right for one release pair and wrong for another (turning the plugin off is
fine on megatron-core 0.19 + Bridge 0.6, and trains on stale and polluted weights on 0.16).
Everything here is probed from the installed *files* (:func:`.defects.probe_core_files`, Bridge's
``train.py`` as text), never from version strings and never by importing: ``check`` must not pay
seconds for torch and megatron-core. Versions come from package metadata, for messages only.
The runtime (callbacks, engine) decides from the imported classes instead (:mod:`.upstream`).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .defects import core_defects, probe_core_files
from .upstream import CoreBehaviour, bridge_training_dir

__all__ = ["InstalledStack"]


_DISTS = ("torch", "megatron-core", "megatron-bridge", "lightning", "transformer-engine")


def installed_version(dist: str) -> str | None:
    return _versions().get(dist)


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str | None]:
    """Installed versions from the ``*.dist-info`` directory names on ``sys.path``, for messages.

    What ``importlib.metadata.version`` answers (first match on the path wins), without its
    ~0.1 s import: ``check`` has a one-second budget.
    """
    wanted = {re.sub(r"[-_.]+", "_", d).lower(): d for d in _DISTS}
    out: dict[str, str | None] = dict.fromkeys(_DISTS)
    for entry in sys.path:
        try:
            names = [p.name for p in Path(entry or ".").iterdir() if p.name.endswith(".dist-info")]
        except OSError:
            continue
        for name in names:
            dist, _, version = name[: -len(".dist-info")].partition("-")
            key = wanted.get(re.sub(r"[-_.]+", "_", dist).lower())
            if key is not None and out[key] is None:
                out[key] = version
    return out


def _bridge_train_source() -> str | None:
    root = bridge_training_dir()
    return (root / "train.py").read_text(encoding="utf-8", errors="replace") if root else None


@dataclass(frozen=True)
class InstalledStack:
    """The installed release pair, reduced to the behaviours the config rules depend on.

    Build one with :meth:`detect`, or by hand in tests (``validate_config(..., installed=...)``).
    """

    #: megatron-core's param-sync behaviour; ``None`` when megatron-core is not importable.
    core: CoreBehaviour | None
    #: Defect A fixed (bucket offsets honour the 64-element padding); ``None``: unknown.
    core_pads_bucket_offsets: bool | None
    #: Bridge's loop calls ``optimizer.prepare_model_params_for_param_sync()`` unguarded
    #: (Bridge 0.6); ``None`` when Megatron-Bridge is not installed.
    bridge_calls_prepare: bool | None
    versions: Mapping[str, str | None] = field(default_factory=dict)

    @classmethod
    def detect(cls) -> InstalledStack:
        """Read the installed releases' sources; imports neither torch nor megatron-core."""
        files = probe_core_files()
        core = (
            None
            if files is None
            else CoreBehaviour(
                forced_sync_writes_back=files.forced_sync_writes_back,
                has_dispatch_reset=files.has_dispatch_reset,
                has_prepare_for_param_sync=files.has_prepare_for_param_sync,
                has_reuse_knob=files.has_reuse_knob,
            )
        )
        src = _bridge_train_source()
        return cls(
            core=core,
            core_pads_bucket_offsets=None if files is None else files.pads_bucket_offsets,
            bridge_calls_prepare=None if src is None else "prepare_model_params_for_param_sync(" in src,
            versions=_versions(),
        )

    @property
    def defects(self) -> list[str]:
        """Core-side defects of :data:`.defects.DEFECTS` present here (A, B1, C), decided where
        ``doctor`` decides them (:func:`.defects.core_defects`)."""
        core = self.core
        return core_defects(
            pads_bucket_offsets=self.core_pads_bucket_offsets,
            forced_sync_writes_back=None if core is None else core.forced_sync_writes_back,
            has_dispatch_reset=None if core is None else core.has_dispatch_reset,
        )

    def describe(self) -> str:
        core = self.versions.get("megatron-core") or ("unknown" if self.core else "not installed")
        bridge = self.versions.get("megatron-bridge") or "not installed"
        defects = ", ".join(self.defects) or "none"
        return f"megatron-core {core} (defects: {defects}), megatron-bridge {bridge}"
