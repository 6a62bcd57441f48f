"""The config rules, grouped by what they protect; importing this package registers them all.

* :mod:`.inputs` (MX101-MX103): the file itself - unknown keys, wrong types, recipe names.
* :mod:`.combination` (MX001-MX007, MX012, MX013): knob combinations that megatron-core or
  Bridge reject, or accept and then train wrong.
* :mod:`.padding` (MX008): the distributed optimizer's bucket padding for a dp size.
* :mod:`.release` (MX009-MX011): what the *installed* release pair needs (the defect table).
* :mod:`.hazards` (MX014-MX016): known upstream failures the plugin cannot repair, gated on the
  installed pair (the hazard table; MX007 in :mod:`.combination` is one of them too).

Each rule reads knobs only through :class:`..effective.EffectiveConfig` (Bridge's precedence applied
once, in one place) and returns one :class:`..report.RuleResult`.
"""

from __future__ import annotations

from ..report import Rule
from . import combination, hazards, inputs, padding, release
from ._base import REGISTRY, run_rules

__all__ = ["RULES", "combination", "hazards", "inputs", "padding", "release", "run_rules"]

RULES: tuple[Rule, ...] = tuple(sorted((r for r, _ in REGISTRY), key=lambda r: r.id))
