"""What the installed releases are and do: the one place in the plugin that knows a release.

One record per thing probed: :class:`CoreBehaviour` (megatron-core's param sync, from the
imported classes or from the installed files), :class:`BridgeLoopBehaviour` (what Bridge's and
Megatron-LM's training loops do at forced syncs, :mod:`.loops`), :class:`HazardBehaviour` (the
known hazards the plugin cannot repair), :class:`InstalledStack` (the release pair, for the config
check), plus one version reader. For the config check: :mod:`.fields` (the installed config
classes' fields and annotations), :mod:`.bridge_facts` (per-release Bridge facts: written down
where its files cannot say, read where they can), :mod:`.recipe_source` (what a recipe function
sets). Nothing here imports torch or megatron-core at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._source import module_file
    from .core import CoreBehaviour, core_package_dir, probe_bucket_offsets, probe_core, probe_core_files
    from .hazards import HazardBehaviour, probe_hazard_files
    from .loops import BridgeLoopBehaviour, bridge_training_dir, probe_bridge_files, probe_live_loop
    from .stack import InstalledStack
    from .versions import installed_version, installed_versions

#: public name -> the submodule that defines it. Loaded on first use (PEP 562): ``check`` imports
#: one probe module and would otherwise pay for all of them (a fifth of its own time).
_WHERE = {
    "module_file": "_source",
    "CoreBehaviour": "core",
    "core_package_dir": "core",
    "probe_bucket_offsets": "core",
    "probe_core": "core",
    "probe_core_files": "core",
    "HazardBehaviour": "hazards",
    "probe_hazard_files": "hazards",
    "BridgeLoopBehaviour": "loops",
    "bridge_training_dir": "loops",
    "probe_bridge_files": "loops",
    "probe_live_loop": "loops",
    "InstalledStack": "stack",
    "installed_version": "versions",
    "installed_versions": "versions",
}


__all__ = [
    "BridgeLoopBehaviour",
    "CoreBehaviour",
    "HazardBehaviour",
    "InstalledStack",
    "bridge_training_dir",
    "core_package_dir",
    "installed_version",
    "installed_versions",
    "module_file",
    "probe_bridge_files",
    "probe_bucket_offsets",
    "probe_core",
    "probe_core_files",
    "probe_hazard_files",
    "probe_live_loop",
]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
