"""The shard check: sampled blocks of every owned slice against their quantized main shard.

Per param the work is a few strided views (no copy where rows are whole blocks); the reads, the
reference quantization and the comparison run once per batch of params that share a type and
configuration, so the host cost does not grow with the ops per param. A batch holds at most
``batch_elements`` elements, set from the memory budget (``verify_weights``): the check's extra
memory is bounded by that, not by the model. Verdicts stay on the device until one read at the
end; only a failed batch is compared again param by param, to name the params.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import MXFP8UsageError
from .read import BLOCK, Blocks, Reader, decode
from .reference import Reference, make_reference, self_check
from .report import ParamMismatch, WeightReport

__all__ = ["Owned", "ShardCheck", "first_sampled", "stride_of"]

#: Extra bytes per compared element at a batch's peak, which sizes a batch from the memory
#: budget. Counted on the kit's TE-shaped type: the decoded blocks and the rounded main blocks
#: (2 + 2, after transients of 5 and 6), the reference instance's codes (1), and the larger of
#: its cast's temporaries (about 13 for the emulated TE-rule cast) and its dequantize's (about
#: 14: fp32 values and scales); about 19 in all. TE's fused kernels need less. The margin keeps
#: a 4B model's sampled check under 64 MiB even where 1% of its param bytes is more.
BYTES_PER_ELEMENT = 32


@dataclass
class Owned:
    """The main shard of a param this rank owns, and the slice of the param it covers."""

    main: torch.Tensor | None
    start: int
    end: int
    buffer_dtype: torch.dtype | None  # dtype of the bucket's param_data (what the gather moves)


def stride_of(sample: float) -> int:
    if not 0.0 < sample <= 1.0:
        raise MXFP8UsageError(f"verify sample must be in (0, 1], got {sample!r}")
    return max(1, round(1.0 / sample))


def first_sampled(offset: int, stride: int, blocks: int) -> int:
    """The first sampled block of ``blocks``: rotates with ``offset`` over ``min(stride, blocks)``
    phases, so every block is visited within ``stride`` calls and every param yields one."""
    return offset % max(1, min(stride, blocks))


@dataclass
class _Slot:
    """One param's share of the check: its verdict and what it covered."""

    name: str
    elements: int
    skipped: int
    unchecked: str = ""
    differing: int = 0
    worst: float = 0.0


@dataclass
class _Item:
    slot: int
    reader: Reader
    main: torch.Tensor
    start: int  # the shard's first element: main[i - start] is the param's element i
    blocks: Blocks
    tail: tuple[torch.Tensor, torch.Tensor] | None = None  # a bf16 shard's last, short run


@dataclass
class _Batch:
    key: tuple[Any, ...]
    param: Any  # representative: its type and configuration are the batch's
    mxfp8: bool
    round_to: torch.dtype | None
    items: list[_Item] = field(default_factory=list)
    blocks: int = 0


class ShardCheck:
    """The shard check of one ``verify_weights`` call."""

    def __init__(self, report: WeightReport, atol: float, stride: int, offset: int, batch_elements: int):
        self.report, self.atol, self.stride, self.offset = report, atol, stride, offset
        self.batch_blocks = max(BLOCK, batch_elements // BLOCK)
        self.batches: dict[tuple[Any, ...], _Batch] = {}
        self.slots: list[_Slot] = []
        self.references: dict[tuple[Any, ...], Reference] = {}
        self.refused: dict[tuple[Any, ...], str] = {}  # batch key -> why its type cannot be checked
        self.trusted: set[tuple[Any, ...]] = set()  # keys whose reader passed the self-check
        self.verdicts: list[tuple[_Batch, torch.Tensor]] = []

    def add(self, name: str, param: Any, reader: Reader, own: Owned, mxfp8: bool) -> None:
        """Queue the sampled blocks of ``param``'s owned slice."""
        main = own.main
        assert main is not None
        if main.dim() != 1 or not main.is_contiguous():
            main = main.reshape(-1)
        s, e, buf = own.start, own.end, own.buffer_dtype
        # In reuse mode the main shard travels as bf16 (staged into the bf16 view of the grad
        # buffer); with a uint8 FP8 buffer it is cast from fp32 directly.
        round_to = buf if buf is not None and buf.is_floating_point and buf.itemsize >= 2 else None
        quantizer = getattr(param, "_quantizer", None)
        key = (mxfp8, type(param), param.dtype, round_to, type(quantizer), getattr(quantizer, "dtype", None),
               reader.kind)  # fmt: skip
        slot = len(self.slots)
        if mxfp8:
            blocks, whole = self._mxfp8_blocks(param, s, e)
            self.slots.append(_Slot(name, blocks.elements(), (e - s) - whole))
            item = _Item(slot, reader, main, s, blocks)
        else:
            item = self._plain_item(slot, reader, main, s, e)
            tail = (e - s) % BLOCK if item.tail is not None else 0
            self.slots.append(_Slot(name, item.blocks.count * BLOCK + tail, 0))
        if key in self.refused:
            self.slots[slot].unchecked = self.refused[key]
            return
        batch = self.batches.get(key) or self.batches.setdefault(key, _Batch(key, param, mxfp8, round_to))
        lo = 0
        while True:  # split a param across batches where it does not fit
            room = self.batch_blocks - batch.blocks
            part = item.blocks.part(lo, min(room, item.blocks.count - lo))
            last = lo + part.count >= item.blocks.count
            batch.items.append(_Item(slot, reader, main, s, part, item.tail if last else None))
            batch.blocks += part.count
            lo += part.count
            if batch.blocks >= self.batch_blocks:
                self._flush(key)
                batch = self.batches.setdefault(key, _Batch(key, param, mxfp8, round_to))
            if last:
                return

    def _mxfp8_blocks(self, param: Any, s: int, e: int) -> tuple[Blocks, int]:
        """The sampled blocks lying wholly inside the shard ``[s, e)``, and the elements in all
        whole blocks there. A block straddling two ranks' shards has a scale this rank cannot
        compute, so it is skipped (and counted)."""
        last = param.shape[-1] if param.dim() > 0 else 1
        per_row = -(-last // BLOCK)
        # Whole blocks inside [s, e) form one range of global block ids (row * per_row + j).
        r, c = divmod(s, last)
        j = -(-c // BLOCK)
        g0 = r * per_row + j if j < per_row else (r + 1) * per_row
        r, c = divmod(e, last)
        g1 = max(g0, r * per_row + c // BLOCK)
        n = g1 - g0
        first = first_sampled(self.offset, self.stride, n)
        blocks = Blocks(last, g0 + first, max(0, -(-(n - first) // self.stride)), self.stride)
        # Elements in whole blocks: each row's last block holds only ``last % 32``.
        short = 0 if last % BLOCK == 0 else (g1 // per_row - g0 // per_row) * (BLOCK - last % BLOCK)
        return blocks, n * BLOCK - short

    def _plain_item(self, slot: int, reader: Reader, main: torch.Tensor, s: int, e: int) -> _Item:
        """Runs of 32 counted from the shard start (no scale: any grouping compares the same)."""
        n = (e - s) // BLOCK
        first = first_sampled(self.offset, self.stride, n)
        blocks = Blocks(BLOCK, first, max(0, -(-(n - first) // self.stride)), self.stride, origin=s)
        tail = None
        if (e - s) % BLOCK and (self.stride == 1 or n == 0):
            pad = (0, BLOCK - (e - s) % BLOCK)
            tail = (
                torch.nn.functional.pad(reader.flat[s + n * BLOCK : e], pad).view(1, BLOCK),
                torch.nn.functional.pad(main[n * BLOCK : e - s], pad).view(1, BLOCK),
            )
        return _Item(slot, reader, main, s, blocks, tail)

    def _sides(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The batch's blocks as read from the params, the reference blocks, and the reference
        instance (None for bf16 params). One gather per side; codes are decoded once per batch."""
        dtype = batch.param.dtype
        got, main = [], []
        for it in batch.items:
            got.append(it.blocks.take(it.reader.flat))
            main.append(it.blocks.take(it.main, -it.start))
            if it.tail is not None:
                got.append(it.tail[0])
                main.append(it.tail[1])
        got_all = _cat(got)
        reader = batch.items[0].reader  # one kind and element format per batch (its key)
        if reader.scales is not None:
            scales = _cat([_scales_of(it) for it in batch.items])
            got_all = decode(got_all, scales, reader.element, dtype)
        del got
        rows = _cat(main)
        del main
        if batch.round_to is not None:
            rows = rows.to(batch.round_to)
        if not batch.mxfp8:
            return got_all, rows.to(dtype).to(got_all.device), None
        reference = self.references.get(batch.key)
        if reference is None:
            reference = self.references[batch.key] = make_reference(batch.param)
        want, small = reference(rows)
        return got_all, want.to(got_all.device), small

    def _flush(self, key: tuple[Any, ...]) -> None:
        """Compare one batch; the verdict stays on the device (no host sync per batch)."""
        batch = self.batches.pop(key, None)
        if batch is None or not batch.items:
            return
        try:
            got, want, small = self._sides(batch)
            if small is not None and key not in self.trusted:
                reason = self_check(self.references[key], small, want)
                if reason:
                    raise _Refused(reason)
                self.trusted.add(key)
            if self.atol:
                differs = ~((got.float() - want.float()).abs() <= self.atol).all()
            else:
                differs = (got != want).any()  # NaN counts as a difference
            self.verdicts.append((batch, differs))
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            reason = str(exc) if isinstance(exc, _Refused) else _why(batch, exc)
            self.refused[key] = reason
            for it in batch.items:
                self.slots[it.slot].unchecked = reason

    def finish(self, max_names: int) -> None:
        """Flush what is left, read every batch's verdict in one transfer, attribute the
        differences of a failed batch to its params (recomputed: the failure path only), and fill
        the report."""
        for key in list(self.batches):
            self._flush(key)
        if self.verdicts:
            failed = torch.stack([d for _, d in self.verdicts]).tolist()
            for (batch, _), bad in zip(self.verdicts, failed, strict=True):
                if bad:
                    self._attribute(batch)
        self._tally(max_names)

    def _attribute(self, batch: _Batch) -> None:
        got, want, _ = self._sides(batch)
        row = 0
        for it in batch.items:
            rows = it.blocks.count + (it.tail is not None)
            g, w = got[row : row + rows], want[row : row + rows]
            row += rows
            if g.numel() == 0 or torch.equal(g, w):
                continue
            diff = (g.float() - w.float()).abs()
            count = int((~(diff <= self.atol)).sum())  # NaN counts as a difference
            slot = self.slots[it.slot]
            slot.differing += count
            if count:
                slot.worst = max(slot.worst, float(diff.nan_to_num(nan=float("inf")).max()))

    def _tally(self, max_names: int) -> None:
        report = self.report
        for slot in self.slots:
            if slot.unchecked:
                report.unchecked.append(f"{slot.name}: {slot.unchecked}")
                continue
            report.params_checked += 1
            report.elements_checked += slot.elements
            report.elements_skipped += slot.skipped
            if slot.differing:
                report.shard_mismatch_count += 1
                if len(report.shard_mismatches) < max_names:
                    report.shard_mismatches.append(ParamMismatch(slot.name, slot.worst, slot.differing))
        for key, reference in self.references.items():
            if key not in self.refused:
                params = {s for b, _ in self.verdicts if b.key == key for s in (it.slot for it in b.items)}
                report.count_path(f"{reference.path}, read {key[-1]}", len(params))


def _scales_of(item: _Item) -> torch.Tensor:
    assert item.reader.scales is not None
    return item.blocks.take_scales(item.reader.scales, item.reader.scale_cols)


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


class _Refused(Exception):
    """The type's blocks cannot be read or referenced the way the type does it."""


def _why(batch: _Batch, exc: Exception) -> str:
    kind = type(batch.param).__name__
    return f"no same-type reference for {kind} ({type(exc).__name__}: {exc})"
