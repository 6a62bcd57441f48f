"""What a shard check plans: per-param slots, views of their sampled blocks, and batches of them.

A batch groups the params that share a type and configuration, so one read, one reference write
and one comparison serve them all; its size is capped so the check's extra memory stays within
the budget. The same packing splits a plan's params into batches and, on the failure path, a
flagged batch into parts the type's own write can judge within the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .read import BLOCK, Blocks, Reader, decode
from .reference import Reference, make_reference
from .report import WeightReport

__all__ = ["Batch", "Item", "Owned", "Slot", "at_phase", "bytes_differ", "count_slots", "pack", "split"]


@dataclass
class Owned:
    """The main shard of a param this rank owns, and the slice of the param it covers."""

    main: torch.Tensor | None
    start: int
    end: int
    buffer_dtype: torch.dtype | None  # dtype of the bucket's param_data (what the gather moves)


@dataclass
class Slot:
    """One param's share of the check: its verdict and what it covered."""

    name: str
    elements: int
    skipped: int
    unchecked: str = ""
    differing: int = 0
    worst: float = 0.0
    #: an MXFP8 weight, with its type's name: where it ends unchecked, the verdict is NOT CHECKED
    mxfp8_type: str = ""
    #: the sampled blocks (their elements at each phase are what it covers then) and the
    #: compared elements of a short run past them
    sampled: Blocks | None = None
    tail: int = 0
    _at: dict[int, int] = field(default_factory=dict)

    def count_every_phase(self, stride: int, tables: dict[Any, dict[int, int]]) -> None:
        """Its elements at every phase, in a table shared with the slots of its geometry
        (``tables``): a model's layers mostly share one, and a table each cost more than the rest
        of a plan's first call."""
        if self.sampled is None:
            return
        key = (self.sampled, self.tail)
        table = tables.get(key)
        if table is None:
            table = tables[key] = {v: self.sampled.at(v).elements() + self.tail for v in range(stride)}
        self._at = table

    def covered(self, value: int) -> int:
        """Elements compared at sampled phase ``value`` (host arithmetic, kept per phase)."""
        if self.sampled is None:
            return self.elements
        if value not in self._at:
            self._at[value] = self.sampled.at(value).elements() + self.tail
        self.elements = self._at[value]
        return self.elements


@dataclass
class Item:
    slot: int
    reader: Reader
    main: torch.Tensor
    start: int  # the shard's first element: main[i - start] is the param's element i
    blocks: Blocks
    tail: tuple[torch.Tensor, torch.Tensor] | None = None  # a bf16 shard's last, short run (views)
    mxfp8_codes: bool = False  # an MXFP8 param read from codes and scales: compared by bytes
    _views: dict[str, torch.Tensor] = field(default_factory=dict)

    def got(self) -> torch.Tensor:
        """The param's blocks (values, or codes), ``(count, 32)``."""
        return self._view("got", lambda: self.blocks.take(self.reader.flat))

    def want(self) -> torch.Tensor:
        """The main shard's blocks, ``(count, 32)``."""
        return self._view("want", lambda: self.blocks.take(self.main, -self.start))

    def scales(self) -> torch.Tensor:
        """The E8M0 byte of each block, ``(count,)``."""
        assert self.reader.scales is not None
        scales, cols = self.reader.scales, self.reader.scale_cols
        strided = cols == self.blocks.per_row  # else an index gather: a copy
        return self._view("scales", lambda: self.blocks.take_scales(scales, cols), strided)

    def _view(self, which: str, make: Callable[[], torch.Tensor], strided: bool = True) -> torch.Tensor:
        """Strided views are kept for the plan's next use (they read the current bits); a
        gather (a ragged row's zero-padded blocks, padded scale rows) is a copy, so it is taken
        anew every time."""
        view = self._views.get(which)
        if view is None:
            view = make()
            if strided and self.blocks.is_view:
                self._views[which] = view
        return view


@dataclass
class Batch:
    key: tuple[Any, ...]
    param: Any  # representative: its type and configuration are the batch's
    mxfp8: bool
    round_to: torch.dtype | None
    items: list[Item] = field(default_factory=list)
    blocks: int = 0

    def fresh(self) -> Batch:
        """An empty batch of the same key, for what no longer fits in this one."""
        return Batch(self.key, self.param, self.mxfp8, self.round_to)


def pack(item: Item, cap: int, batch: Batch, full: Callable[[], Batch]) -> Batch:
    """Append ``item``'s blocks to ``batch``, split where it fills: each full batch is handed to
    ``full``, which returns the batch to go on with. Returns the batch left open. Only the last
    part of an item carries its short run, which no block count includes."""
    if batch.blocks + item.blocks.count < cap:  # the usual case of a sample: it fits whole
        batch.items.append(item)
        batch.blocks += item.blocks.count
        return batch
    lo = 0
    while True:
        part = item.blocks.part(lo, min(cap - batch.blocks, item.blocks.count - lo))
        last = lo + part.count >= item.blocks.count
        tail = item.tail if last else None
        batch.items.append(Item(item.slot, item.reader, item.main, item.start, part, tail, item.mxfp8_codes))
        batch.blocks += part.count
        lo += part.count
        if batch.blocks >= cap:
            batch = full()
        if last:
            return batch


def at_phase(batch: Batch, value: int) -> Batch:
    """``batch`` with each item's blocks exactly those of sampled phase ``value`` (no block
    read twice): what the failure path counts differing elements on."""
    out = batch.fresh()
    for it in batch.items:
        blocks = it.blocks.at(value)
        if blocks.count or it.tail is not None:
            out.items.append(Item(it.slot, it.reader, it.main, it.start, blocks, it.tail, it.mxfp8_codes))
            out.blocks += blocks.count
    return out


def split(batch: Batch, cap: int) -> list[Batch]:
    """``batch`` as batches of at most ``cap`` blocks (items split where they cross a border)."""
    parts = [batch.fresh()]

    def full() -> Batch:
        parts.append(batch.fresh())
        return parts[-1]

    open_part = parts[0]
    for it in batch.items:
        open_part = pack(it, cap, open_part, full)
    return [p for p in parts if p.items]


def rounded(main: torch.Tensor, round_to: torch.dtype | None) -> torch.Tensor:
    return main.to(round_to) if round_to is not None else main


def padded_rows(main: torch.Tensor, k: int, round_to: torch.dtype | None) -> torch.Tensor:
    """An uninitialised ``(k, 32)`` batch of rows with zero rows up to a multiple of 32."""
    pad = (-k) % BLOCK
    rows = torch.empty((k + pad, BLOCK), dtype=round_to or main.dtype, device=main.device)
    if pad:
        rows[k:].zero_()
    return rows


def cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def sides(
    batch: Batch, references: dict[tuple[Any, ...], Reference]
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The batch's blocks as read from the params, the reference blocks, and the reference
    instance (None for bf16 params). One gather per side; codes are decoded once per batch."""
    dtype = batch.param.dtype
    got, main = [], []
    for it in batch.items:
        got.append(it.got())
        main.append(it.want())
        if it.tail is not None:  # padded when read: a plan holds views only
            pad = (0, BLOCK - it.tail[0].numel())
            got.append(torch.nn.functional.pad(it.tail[0], pad).view(1, BLOCK))
            main.append(torch.nn.functional.pad(it.tail[1], pad).view(1, BLOCK))
    got_all = cat(got)
    reader = batch.items[0].reader  # one kind and element format per batch (its key)
    if reader.scales is not None:
        scales = cat([it.scales() for it in batch.items])
        got_all = decode(got_all, scales, reader.element, dtype)
    del got
    rows = cat(main)
    del main
    if batch.round_to is not None:
        rows = rows.to(batch.round_to)
    if not batch.mxfp8:
        return got_all, rows.to(dtype).to(got_all.device), None
    reference = references.get(batch.key)
    if reference is None:
        reference = references[batch.key] = make_reference(batch.param)
    want, small = reference(rows)
    return got_all, want.to(got_all.device), small


def main_rows(batch: Batch) -> torch.Tensor:
    """The batch's main blocks as the gather delivers them, ``(k, 32)`` contiguous, zero
    rows appended up to whole 32-row tiles (TE quantizes whole tiles; a zero row is a block
    of its own): one rounding copy per param."""
    items = batch.items
    if len(items) == 1 and batch.blocks % BLOCK == 0:
        it = items[0]
        return rounded(it.want(), batch.round_to).contiguous()
    rows = padded_rows(items[0].main, batch.blocks, batch.round_to)
    # One cat into the rounded rows (the copies loop in C++, not here).
    torch.cat([it.want() for it in items], out=rows[: batch.blocks])
    return rows


def got_bytes(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The param's codes ``(k, 32)`` and scale bytes ``(k,)``: views where one param fills
    the batch, else one gathering copy per param."""
    items = batch.items
    if len(items) == 1:
        return items[0].got(), items[0].scales()
    flat = items[0].reader.flat
    codes = torch.empty((batch.blocks, BLOCK), dtype=flat.dtype, device=flat.device)
    scales = torch.empty((batch.blocks,), dtype=torch.uint8, device=flat.device)
    torch.cat([it.got() for it in items], out=codes)
    torch.cat([it.scales() for it in items], out=scales)
    return codes, scales


def bytes_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether any byte differs (0-d, on the device): 8 bytes per compare where the layout lets."""
    try:
        a, b = a.view(torch.int64), b.view(torch.int64)
    except RuntimeError:
        pass
    return torch.ne(a, b).any()


def values_differ(got: torch.Tensor, want: torch.Tensor, atol: float) -> torch.Tensor:
    """Where ``got`` differs from ``want``: not equal, nor within ``atol`` where it is set. A NaN
    against a number differs; NaN on both sides is equal, as the byte compares judge it (the check
    judges whether the weights are current, not whether they are finite: a job whose weights
    went NaN or inf must not read as a sync defect)."""
    if atol:
        same = ((got.float() - want.float()).abs() <= atol) | (got == want)  # inf against inf: equal
    else:
        same = got == want
    return ~(same | (got.isnan() & want.isnan()))


def count_slots(slots: Iterable[Slot], phase: int, report: WeightReport) -> None:
    """Each slot into ``report``: compared (its elements at sampled ``phase``) or unchecked."""
    for slot in slots:
        if slot.unchecked:
            report.add_unchecked(slot.name, slot.unchecked, slot.mxfp8_type)
            continue
        report.params_checked += 1
        report.mxfp8_checked += bool(slot.mxfp8_type)
        report.elements_checked += slot.covered(phase)
        report.elements_skipped += slot.skipped


def elements_per_phase(slots: Iterable[Slot], stride: int) -> list[int]:
    """Elements the checked slots compare at each phase, once their counts at every phase are
    known (``Slot.count_every_phase``): a replayed plan's tally of a phase it has not run yet,
    without visiting every slot at a check (after a training step each visit is a cache miss).
    Slots sharing a geometry share a table, so the sum runs over tables, not slots."""
    tables: dict[int, list[Any]] = {}
    fixed = 0
    for slot in slots:
        if slot.unchecked:
            continue
        if slot.sampled is None:
            fixed += slot.elements
            continue
        if len(slot._at) < stride:
            return []  # not counted at every phase: the caller counts slots
        tables.setdefault(id(slot._at), [slot._at, 0])[1] += 1
    return [fixed + sum(at[v] * n for at, n in tables.values()) for v in range(stride)]
