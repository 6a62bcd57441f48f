"""Launch tables: a batch's item rows as the segments a kernel searches, and their trip to the
device in one copy per plan.

A launch's addresses and geometry are data (``fused``'s launches), made on the host at plan time.
Sent one segment at a time from pageable memory, each was a blocking driver call, and a plan of a
4B model is a few hundred batches: on the plan's first call, host-bound, that was time the job
waited for. ``Tables`` holds them until the plan has made them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Segment", "Tables", "segments"]


@dataclass
class Segment:
    """Up to ``_program_rows.MAX_ROWS`` items of a batch's table: one launch of ``programs``
    programs, each finding its item's row by the row's first program (counted from 0 in each
    segment). Made as Python rows (``host``) and sent with the plan's other tables: a tensor per
    segment on the host was most of a table's cost (a full 1B check is ~90 batches, ~300 own-write
    batches through TE's rule, ~50 us each)."""

    items: torch.Tensor | None  # int64 (rows, fields) on the device; None until sent
    rows: int
    programs: int
    bound: int  # the kernel's ROWS (``_program_rows.MAX_ROWS``)
    host: list[list[int]] | None = None  # the rows until sent (a template packs them)

    @property
    def grid(self) -> tuple[int]:
        return (self.programs,)


class Tables:
    """Segments made on the host, sent by ``upload`` in one copy per device. No launch may read
    one before then: its table is still a host list."""

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
        """``segment`` (its rows still on the host), to be sent to ``device`` by ``upload``."""
        self._held.append((segment, device))
        return segment

    def upload(self) -> None:
        """Every held table to its device, as views of one tensor made from every row at once."""
        by_device: dict[Any, list[Segment]] = {}
        for segment, device in self._held:
            by_device.setdefault(torch.device(device), []).append(segment)
        for device, held in by_device.items():
            flat = [v for s in held for row in s.host or () for v in row]
            sent = torch.tensor(flat, dtype=torch.int64).to(device)
            at = 0
            for s in held:
                assert s.host is not None
                size = s.rows * len(s.host[0])
                s.items, s.host = sent[at : at + size].view(s.rows, -1), None
                at += size
        self._held.clear()


def segments(
    rows: list[list[int]], chunks: list[int], field: int, device: Any, tables: Tables | None
) -> tuple[Segment, ...]:
    """``rows`` (``chunks`` programs each) as segments a kernel can search, each row's first
    program written into column ``field`` (counted from 0 in each segment); sent with ``tables``
    (or at once, a copy each, where there is none). ``rows`` are the caller's, made for them."""
    from . import _program_rows

    most = _program_rows.MAX_ROWS
    out = []
    for lo in range(0, len(rows), most):
        part = rows[lo : lo + most]
        first = 0
        for row, count in zip(part, chunks[lo : lo + most], strict=True):
            row[field] = first
            first += count
        segment = Segment(None, len(part), first, most, part)
        if tables is None:
            segment.items, segment.host = torch.tensor(part, dtype=torch.int64).to(device), None
        else:
            tables.add(segment, device)
        out.append(segment)
    return tuple(out)
