"""The installed release pair, as far as a config check needs to know.

A config can be right for one release pair and wrong for another (turning the plugin off is
fine on megatron-core 0.19 + Bridge 0.6, and trains on stale and polluted weights on 0.16), so
the config rules read this record. :meth:`InstalledStack.detect` reads the installed files only:
``check`` must not pay seconds for torch and megatron-core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from ..common.records import record
from ._source import read_text
from .core import CoreBehaviour, probe_core_files
from .defects import core_defects
from .hazards import HazardBehaviour, probe_hazard_files
from .loops import bridge_training_dir
from .versions import PackageOrigin, installed_versions, package_origin

__all__ = ["InstalledStack"]

#: Bridge 0.6's loop stages through megatron-core 0.19's optimizer helper, unguarded.
_CALLS_PREPARE = "prepare_model_params_for_param_sync("


@record
class InstalledStack:
    """The installed release pair, reduced to the behaviours the config rules depend on.

    Build one with :meth:`detect`, or by hand in tests (``validate_config(..., installed=...)``).
    """

    #: megatron-core's param-sync behaviour; ``None`` when megatron-core is not installed.
    core: CoreBehaviour | None
    #: Bridge's loop calls ``optimizer.prepare_model_params_for_param_sync()`` unguarded
    #: (Bridge 0.6); ``None`` when Megatron-Bridge is not installed.
    bridge_calls_prepare: bool | None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    #: What the pair does about the known hazards (MX007, MX014-MX016); ``None``: not probed,
    #: and those rules judge the config alone.
    hazards: HazardBehaviour | None = None
    #: Where ``megatron.bridge`` comes from (its own distribution, Megatron-LM's, a source tree);
    #: ``None``: not installed, or not probed.
    bridge_origin: PackageOrigin | None = None

    @classmethod
    def detect(cls) -> InstalledStack:
        """Read the installed releases' sources; imports neither torch nor megatron-core."""
        root = bridge_training_dir()
        train_py = None if root is None else read_text(root, "train.py")
        return cls(
            core=probe_core_files(),
            bridge_calls_prepare=None if train_py is None else _CALLS_PREPARE in train_py,
            versions=installed_versions(),
            hazards=probe_hazard_files(),
            bridge_origin=package_origin("bridge"),
        )

    @property
    def defects(self) -> list[str]:
        """Core-side defects (A, B1, C) known to be present; see :attr:`defects_known`."""
        return [d for d, present in core_defects(self.core).items() if present]

    @property
    def defects_known(self) -> bool:
        """Whether :attr:`defects` is a verdict (False: megatron-core was not found, or not probed)."""
        return all(p is not None for p in core_defects(self.core).values())

    def describe(self) -> str:
        core = self.versions.get("megatron-core") or ("unknown" if self.core else "not installed")
        bridge = self.versions.get("megatron-bridge") or "not installed"
        origin = self.bridge_origin
        if origin is not None and origin.distribution != "megatron-bridge":
            bridge = origin.describe()  # folded into Megatron-LM's distribution, or a source tree
        if self.core is None:
            defects = "unknown"
        else:
            found = core_defects(self.core)
            named = [d for d, p in found.items() if p] + [f"{d}?" for d, p in found.items() if p is None]
            defects = ", ".join(named) or "none"
        return f"megatron-core {core} (defects: {defects}), megatron-bridge {bridge}"
