"""Which batches of a call count into its one zeroed flags tensor, and where.

Fused and kernel-compared values batches add their differing bytes or elements to a slot each;
the own-write batches with a ``fused.GatherLaunch`` that no template holds add their differing
codes after them. All of them start from one fill per call: inside a capture that is one node
of the plan's graph, whose launch costs the host in proportion to its nodes, where a fill per
batch would be a node each. A values batch on another device than the first keeps its gathers
(its slot would live on the wrong device).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from . import fused
from ._templates import Template
from .batches import Batch

__all__ = ["new_flags", "stack_verdicts"]


def new_flags(
    planned: Sequence[Batch],
    launches: Mapping[int, Any],
    templates: Sequence[Template],
    fused_keys: Collection[Any],
    refused: Collection[Any],
) -> tuple[dict[int, int], dict[int, int], torch.Tensor | None]:
    """The call's zeroed counters (allocated where called: inside a capture, in the graph's
    pool) with each batch's slot in them: ``(flag_of, count_of, flags)``, batch ids as keys."""
    templated = {id(b) for t in templates for b in t.batches}
    live = [b for b in planned if b.key not in refused]
    flagged = [b for b in live if b.key in fused_keys or isinstance(launches.get(id(b)), fused.ValuesLaunch)]
    gathers = [b for b in live if isinstance(launches.get(id(b)), fused.GatherLaunch)]
    counted = [b for b in gathers if id(b) not in templated]
    if not flagged and not counted:
        return {}, {}, None
    device = (flagged or counted)[0].items[0].main.device
    flagged = [b for b in flagged if b.key in fused_keys or b.items[0].main.device == device]
    counted = [b for b in counted if b.items[0].main.device == device]
    flag_of = {id(b): i for i, b in enumerate(flagged)}
    count_of = {id(b): i for i, b in enumerate(counted, len(flagged))}
    return flag_of, count_of, torch.zeros(len(flagged) + len(counted), dtype=torch.int32, device=device)


def stack_verdicts(
    verdicts: list[tuple[Batch, torch.Tensor]], flags: torch.Tensor | None
) -> tuple[list[tuple[Batch, torch.Tensor]], torch.Tensor]:
    """The verdicts as one tensor, and the verdicts in its order. Where each is its own slot of
    ``flags`` and together they fill it (every batch of the plan counted there: the fused path, a
    few-batch own-write plan), that is ``flags`` itself, the verdicts put in slot order: no copy,
    so a kernel fewer, and in a capture a node fewer in the plan's graph. Else a stack."""
    if flags is not None and len(verdicts) == flags.numel():
        start = flags.storage_offset()
        slots = [v.storage_offset() - start if v._base is flags and v.dim() == 0 else -1 for _, v in verdicts]
        if sorted(slots) == list(range(len(slots))):
            order = sorted(range(len(slots)), key=slots.__getitem__)
            return [verdicts[i] for i in order], flags
    return verdicts, torch.stack([v for _, v in verdicts])
