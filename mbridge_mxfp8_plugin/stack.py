"""What the installed megatron-core / Megatron-Bridge do, as far as a config check needs to know.

A config can be right for one release pair and wrong for another (turning the plugin off is
fine on megatron-core 0.19 + Bridge 0.6, and trains on stale and polluted weights on 0.16).
Like :mod:`.upstream`, everything here is probed from the code, never from version strings;
versions are carried for messages only. Megatron-Bridge is inspected by reading its
``train.py`` source, because importing it needs Transformer Engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

from .upstream import CoreBehaviour, bridge_training_dir, installed_versions, probe_bucket_offsets, probe_core

__all__ = ["InstalledStack"]


def _core_pads_bucket_offsets() -> bool | None:
    """Defect A fixed? :func:`.upstream.probe_bucket_offsets` builds a real dummy bucket; if that
    cannot run, the constructor signature tells (the fix, #3007, hands each bucket the buffer's
    padded ``param_index_map``). The live check on real buckets is
    :func:`.buckets.check_bucket_alignment`."""
    try:
        return bool(probe_bucket_offsets())
    except Exception:  # noqa: BLE001 - fall back to the constructor signature
        pass
    try:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        return "param_index_map" in inspect.signature(pgb._ParamAndGradBucket.__init__).parameters
    except Exception:  # noqa: BLE001
        return None


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
        try:
            core: CoreBehaviour | None = probe_core()
        except Exception:  # noqa: BLE001 - no megatron-core: rules that need it report n/a
            core = None
        src = _bridge_train_source()
        return cls(
            core=core,
            core_pads_bucket_offsets=_core_pads_bucket_offsets() if core else None,
            bridge_calls_prepare=None if src is None else "prepare_model_params_for_param_sync(" in src,
            versions=installed_versions(),
        )

    @property
    def defects(self) -> list[str]:
        """Defects of UPSTREAM.md present in the installed megatron-core (A, B1, C)."""
        out: list[str] = []
        if self.core_pads_bucket_offsets is False:
            out.append("A")
        if self.core is not None and not self.core.forced_sync_writes_back:
            out.append("B1")
        if self.core is not None and not self.core.has_dispatch_reset:
            out.append("C")
        return out

    def describe(self) -> str:
        core = self.versions.get("megatron-core") or ("unknown" if self.core else "not installed")
        bridge = self.versions.get("megatron-bridge") or "not installed"
        defects = ", ".join(self.defects) or "none"
        return f"megatron-core {core} (defects: {defects}), megatron-bridge {bridge}"
