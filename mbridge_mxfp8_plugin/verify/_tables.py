"""Launch tables: a batch's item rows as the segments a kernel searches, and their trip to the
device in one copy per plan.

A launch's addresses and geometry are data (``fused``'s launches), made on the host at plan time.
Sent one segment at a time from pageable memory, each was a blocking driver call, and a plan of a
4B model is a few hundred batches: on the plan's first call, host-bound, that was time the job
waited for. ``Tables`` holds them until the plan has made them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

__all__ = ["Segment", "Tables", "segments"]


@dataclass
class Segment:
    """Up to ``_program_rows.MAX_ROWS`` items of a batch's table (on the device once sent): one launch of
    ``programs`` programs, each finding its item's row by the row's first program (counted from
    0 in each segment)."""

    items: torch.Tensor  # int64, (rows, fields)
    rows: int
    programs: int
    bound: int  # the kernel's ROWS (``_program_rows.MAX_ROWS``)

    @property
    def grid(self) -> tuple[int]:
        return (self.programs,)


class Tables:
    """Segments made on the host, sent by ``upload`` in one copy per device. No launch may read
    one before then: its table is still a host tensor."""

    def __init__(self) -> None:
        self._held: list[tuple[Segment, Any]] = []
        self._zeros: dict[Any, torch.Tensor] = {}

    def zero(self, device: Any) -> torch.Tensor:
        """An int64 ``[0]`` on ``device``, one per plan: the table index of a batch's own launch."""
        key = torch.device(device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(1, dtype=torch.int64, device=key)
        return self._zeros[key]

    def add(self, segment: Segment, device: Any) -> Segment:
        """``segment`` (its table still on the host), to be sent to ``device`` by ``upload``."""
        self._held.append((segment, device))
        return segment

    def upload(self) -> None:
        """Every held table to its device, as views of one copy per device."""
        by_device: dict[Any, list[Segment]] = {}
        for segment, device in self._held:
            by_device.setdefault(torch.device(device), []).append(segment)
        for device, held in by_device.items():
            sent = torch.cat([s.items.reshape(-1) for s in held]).to(device)
            at = 0
            for s in held:
                size = s.items.numel()
                s.items = sent[at : at + size].view(s.items.shape)
                at += size
        self._held.clear()


def segments(
    table: torch.Tensor, chunks: list[int], field: int, device: Any, tables: Tables | None
) -> tuple[Segment, ...]:
    """``table``'s rows (``chunks`` programs each) as segments a kernel can search, each row's
    first program written into column ``field`` (counted from 0 in each segment); made at plan
    time and sent with ``tables`` (or at once, a copy each, where there is none). The column is
    worked out on the host and written once, and the segments are views of ``table`` (the
    caller's, made for them): a plan of a full 1B check is ~90 batches, and five small tensor
    operations per segment were a few milliseconds of its first call."""
    from . import _program_rows

    most = _program_rows.MAX_ROWS
    firsts: list[int] = []
    for lo in range(0, len(chunks), most):
        counts = chunks[lo : lo + most]
        firsts.extend(accumulate(counts[:-1], initial=0))
    table[:, field] = torch.tensor(firsts, dtype=table.dtype)
    out = []
    for lo in range(0, table.shape[0], most):
        part = table[lo : lo + most]
        segment = Segment(part, part.shape[0], sum(chunks[lo : lo + most]), most)
        if tables is None:
            segment.items = part.to(device)
        else:
            tables.add(segment, device)
        out.append(segment)
    return tuple(out)
