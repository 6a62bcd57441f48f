"""Naming the params of a batch whose verdict failed: the failure path only.

A batch's verdict says whether any of its params differs; the report must say which, by how
many elements and by how much. That is worked out again, param by param, only for a batch that
failed, so a clean check never pays for it. Bytes that differ are compared by value here (a
checkpoint load re-quantizes some blocks to other bytes with the same values), a bounded chunk at
a time, so attributing a failure stays inside the check's memory budget.
"""

from __future__ import annotations

from typing import Any

import torch

from .batches import Batch, Slot, main_rows, sides, split, values_differ
from .read import BLOCK, decode
from .reference import Reference

__all__ = ["Attribution"]


class Attribution:
    """Counts each param's differing elements into its slot (``slots`` and ``dirty`` are the
    shard check's own, filled in place: ``dirty`` lists the slots counted this call)."""

    def __init__(
        self,
        slots: list[Slot],
        dirty: set[int],
        atol: float,
        budget: int,
        references: dict[tuple[Any, ...], Reference],
        written: dict[tuple[Any, ...], int],
    ) -> None:
        self.slots, self.dirty, self.atol, self.budget = slots, dirty, atol, budget
        self.references, self.written = references, written

    def __call__(self, batch: Batch) -> None:
        """A flagged batch, on that phase's own blocks."""
        if not batch.items:  # only a phase's repeated last block: judged with its own part
            return
        if batch.items[0].mxfp8_codes:
            self._codes(batch)
            return
        got, want, _ = sides(batch, self.references)
        row = 0
        for it in batch.items:
            rows = it.blocks.count + (it.tail is not None)
            self.count(it.slot, got[row : row + rows], want[row : row + rows])
            row += rows

    def _codes(self, batch: Batch) -> None:
        """Values of a batch whose bytes differ, param by param, a bounded chunk at a time."""
        cap = self.written.get(batch.key, batch.blocks)
        if batch.blocks > cap:  # a fused batch: judged by the type's write in budget-sized parts
            for part in split(batch, cap):
                self._codes(part)
            return
        rows = main_rows(batch)
        reference = self.references[batch.key]
        codes, scales = reference.codes(rows, batch.blocks)
        del rows
        element, dtype = batch.items[0].reader.element, batch.param.dtype
        chunk = max(1, self.budget // (16 * BLOCK))
        r = 0
        for it in batch.items:
            got_codes, got_scales = it.got(), it.scales()
            for c0 in range(0, it.blocks.count, chunk):
                c1 = min(it.blocks.count, c0 + chunk)
                got = decode(got_codes[c0:c1], got_scales[c0:c1], element, dtype)
                want = decode(codes[r + c0 : r + c1], scales[r + c0 : r + c1], element, dtype)
                self.count(it.slot, got, want)
            r += it.blocks.count
        reference.release()

    def count(self, slot_id: int, g: torch.Tensor, w: torch.Tensor) -> None:
        if g.numel() == 0 or torch.equal(g, w):
            return
        differs = values_differ(g, w, self.atol)
        count = int(differs.sum())
        slot = self.slots[slot_id]
        slot.differing += count
        if count:
            self.dirty.add(slot_id)
            diff = (g.float() - w.float()).abs()[differs]  # a NaN against a number: inf
            slot.worst = max(slot.worst, float(diff.nan_to_num(nan=float("inf")).max()))
