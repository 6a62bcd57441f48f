"""Launch tables: a batch's item rows as the segments a kernel searches, and their trip to the
device in one copy per plan.

A launch's addresses and geometry are data (``fused``'s launches), made on the host at plan time.
Sent one segment at a time from pageable memory, each was a blocking driver call, and a plan of a
4B model is a few hundred batches: on the plan's first call, host-bound, that was time the job
waited for. ``Tables`` holds them until the plan has made them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
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

    def discard(self, segments: Iterable[Segment]) -> None:
        """Forget ``segments`` unsent: tables no launch will read."""
        drop = {id(s) for s in segments}
        if drop:
            self._held = [(s, device) for s, device in self._held if id(s) not in drop]

    def upload(self) -> None:
        """Every held table to its device, as views of one tensor made from every row at once,
        cut in one call per row width (a slice and a view per segment in Python cost more than
        the copy: a full 4B check's plan holds a few hundred to a few thousand)."""
        by_device: dict[Any, dict[int, list[Segment]]] = {}
        for segment, device in self._held:
            assert segment.host is not None
            widths = by_device.setdefault(torch.device(device), {})
            widths.setdefault(len(segment.host[0]), []).append(segment)
        for device, widths in by_device.items():
            held = [s for group in widths.values() for s in group]  # one width after another
            rows = chain.from_iterable(s.host or () for s in held)
            sent = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64).to(device)
            at = 0
            for width, group in widths.items():
                count = sum(s.rows for s in group)
                views = sent[at : at + count * width].view(count, width).split([s.rows for s in group])
                for s, items in zip(group, views, strict=True):
                    s.items, s.host = items, None
                at += count * width
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
