"""The shard check: sampled blocks of every owned slice against their quantized main shard.

Per param the work is a few strided views (no copy where rows are whole blocks); the reads, the
reference quantization and the comparison run once per batch of params that share a type and
configuration, so the host cost does not grow with the ops per param. A batch holds at most
``batch_elements`` elements, set from the memory budget (``verify_weights``): the check's extra
memory is bounded by that, not by the model. Verdicts stay on the device until one read at the
end; only a failed batch is compared again param by param, to name the params.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import MXFP8UsageError
from . import fused
from .read import BLOCK, Blocks, Reader, decode, reader_for
from .reference import PROBE_ROWS, Reference, make_reference, self_check
from .report import ParamMismatch, WeightReport

__all__ = ["Owned", "Probed", "ShardCheck", "first_sampled", "stride_of"]

#: Extra bytes per compared element at a batch's peak where values are compared (bf16 params,
#: value-holding MXFP8 types): both sides, the reference instance and its cast's temporaries
#: (about 19 with the kit's emulated cast), plus a margin.
BYTES_PER_ELEMENT = 32
#: Where codes and scales are compared (see ``_flush_codes``), the peak is the write: the
#: rounded main blocks (2 bytes, or 4 unrounded), the reference's codes (1) and the write's own
#: temporaries, measured per batch key on a CUDA device (the caching allocator's cumulative
#: count over a probe write: an upper bound of its peak), else the kit's emulated cast's (13).
#: After it the rows are freed; the param's gathered codes (1) and the verdict (1/8) are less.
_DEFAULT_TRANSIENTS = 13.0
#: Blocks per batch where the fused kernel compares (it allocates nothing): one launch per param
#: up to 128M elements, so an eager run costs few launches.
_FUSED_BLOCKS = 1 << 22
_MARGIN = 1.1
#: Measured write temporaries per element, per type, configuration and quantizer function (a
#: process-wide cache: reading the allocator's statistics costs a few hundred microseconds).
_TRANSIENTS: dict[tuple[Any, ...], float] = {}


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
    phases, so every block is visited within ``stride`` calls and every param yields one. It
    depends on ``offset % stride`` only, so a check's plan repeats every ``stride`` calls."""
    return (offset % stride) % max(1, min(stride, blocks))


@dataclass
class Probed:
    """What a check learns about each batch key (type, configuration, reader) by probing it: the
    blocks per batch, whether its reading is trusted or why it is refused, and its reference.
    Shared by the plans of one layout, so the probe write runs once per key, not per phase."""

    capacity: dict[tuple[Any, ...], int] = field(default_factory=dict)
    refused: dict[tuple[Any, ...], str] = field(default_factory=dict)
    trusted: set[tuple[Any, ...]] = field(default_factory=set)
    references: dict[tuple[Any, ...], Reference] = field(default_factory=dict)
    fused: set[tuple[Any, ...]] = field(default_factory=set)  # keys compared by the fused kernel
    written: dict[tuple[Any, ...], int] = field(default_factory=dict)  # blocks per write (fused keys)


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
            if strided and self.blocks.aligned:
                self._views[which] = view
        return view


@dataclass
class _Batch:
    key: tuple[Any, ...]
    param: Any  # representative: its type and configuration are the batch's
    mxfp8: bool
    round_to: torch.dtype | None
    items: list[_Item] = field(default_factory=list)
    blocks: int = 0


class ShardCheck:
    """The shard check of one ``verify_weights`` call, and its plan for the next ones.

    ``add`` only plans: the batches hold views of the params and main shards, nothing read yet.
    ``finish`` reads and compares them. A later call over the same tensors and the same sampled
    phase reuses the plan (``restart``): the host cost of working out blocks, readers, batch keys
    and capacities per param is paid once, not at every check.
    """

    def __init__(
        self,
        report: WeightReport,
        atol: float,
        stride: int,
        offset: int,
        budget_bytes: int,
        probed: Probed | None = None,
    ):
        self.report, self.atol, self.stride, self.offset = report, atol, stride, offset
        self.budget = budget_bytes
        probed = probed or Probed()
        self.capacity = probed.capacity  # batch key -> blocks per batch
        self.empty: dict[tuple[Any, ...], int] = {}  # batch key -> params with no block to compare
        self.batches: dict[tuple[Any, ...], _Batch] = {}
        self.slots: list[_Slot] = []
        self.references = probed.references
        self.refused = probed.refused  # batch key -> why its type cannot be checked
        self.trusted = probed.trusted  # keys whose reader passed the self-check
        self.fused = probed.fused  # keys whose type writes TE's bytes (see ``fused``)
        self.written = probed.written  # a fused key's blocks per write of the type (attribution)
        self._flags: torch.Tensor | None = None  # per call: differing bytes per fused batch
        self._flag_of: dict[int, int] = {}
        self.verdicts: list[tuple[_Batch, torch.Tensor]] = []
        self.planned: list[_Batch] = []  # sealed batches, in the order they are compared
        self.reusable = True  # False once a compare was refused (the plan is not kept)
        self.runs = 0  # finished calls of this plan
        self.graph: Any = None  # the compares captured as one CUDA graph (see ``_capture``)
        self.graph_verdicts: list[tuple[_Batch, torch.Tensor]] = []
        self.no_graph = ""  # why the compares are not replayed from a graph

    def restart(self, report: WeightReport) -> None:
        """Ready the same plan for another call: fresh verdicts into ``report``."""
        self.report, self.verdicts = report, []
        for slot in self.slots:
            slot.differing, slot.worst = 0, 0.0

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
            item = _Item(slot, reader, main, s, blocks, mxfp8_codes=reader.scales is not None)
        else:
            item = self._plain_item(slot, reader, main, s, e)
            tail = (e - s) % BLOCK if item.tail is not None else 0
            self.slots.append(_Slot(name, item.blocks.count * BLOCK + tail, 0))
        if item.blocks.count == 0 and item.tail is None:
            self.empty[key] = self.empty.get(key, 0) + 1  # no whole block here: nothing to compare
            return
        cap = self.capacity.get(key) or self._capacity(key, param, item, round_to)
        if key in self.refused:
            self.slots[slot].unchecked = self.refused[key]
            return
        batch = self.batches.get(key) or self.batches.setdefault(key, _Batch(key, param, mxfp8, round_to))
        lo = 0
        while True:  # split a param across batches where it does not fit
            room = cap - batch.blocks
            part = item.blocks.part(lo, min(room, item.blocks.count - lo))
            last = lo + part.count >= item.blocks.count
            run_tail = item.tail if last else None
            batch.items.append(_Item(slot, reader, main, s, part, run_tail, item.mxfp8_codes))
            batch.blocks += part.count
            lo += part.count
            if batch.blocks >= cap:
                self._seal(key)
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
            tail = (reader.flat[s + n * BLOCK : e], main[n * BLOCK : e - s])
        return _Item(slot, reader, main, s, blocks, tail)

    def _sides(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
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
        got_all = _cat(got)
        reader = batch.items[0].reader  # one kind and element format per batch (its key)
        if reader.scales is not None:
            scales = _cat([it.scales() for it in batch.items])
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

    def _capacity(self, key: tuple[Any, ...], param: Any, item: _Item, round_to: torch.dtype | None) -> int:
        """Blocks per batch of ``key``, from the budget. For codes, a probe write of the first
        blocks (at most ``PROBE_ROWS``) checks the reading against the type's own
        ``dequantize`` (else the key is refused) and measures the write's temporaries."""
        cap = max(BLOCK, self.budget // (BYTES_PER_ELEMENT * BLOCK))
        if not item.mxfp8_codes:
            self.capacity[key] = cap
            return cap
        try:
            reference = self.references[key] = make_reference(param)
            n = min(item.blocks.count, PROBE_ROWS)
            rows = _padded_rows(item.main, n, round_to)
            rows[:n].copy_(item.blocks.part(0, n).take(item.main, -item.start))
            small = reference._empty((rows.shape[0], BLOCK), rows.device)
            update = getattr(type(reference.quantizer), "update_quantized", None)
            measured = key + (rows.device, reference.path, update)
            known = _TRANSIENTS.get(measured)
            before = _allocated(rows.device) if known is None else None
            reference.write(small, rows)
            after = _allocated(rows.device) if before is not None else None
            if not hasattr(small, "dequantize"):
                raise _Refused(f"{type(small).__name__} has no dequantize() to check its reading against")
            with torch._C.DisableTorchFunctionSubclass():
                want = torch.Tensor.to(small.dequantize(), param.dtype)[:n]
            reason = self_check(reference, small, want)
            if reason:
                raise _Refused(reason)
            self.trusted.add(key)
            transients = _DEFAULT_TRANSIENTS if known is None else known
            if before is not None and after is not None:
                transients = _TRANSIENTS[measured] = (after - before) / rows.numel()
            per_element = _MARGIN * (rows.element_size() + 1 + transients) + 0.25
            cap = max(BLOCK, int(self.budget / (per_element * BLOCK)) // BLOCK * BLOCK)
            if self._agrees_with_fused(item, reference, small, n, round_to):
                # The kernel allocates nothing: its batches are bounded only so that a flagged
                # one is judged again by the type's write a budget-sized part at a time.
                self.fused.add(key)
                self.written[key] = cap
                cap = max(cap, _FUSED_BLOCKS)
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            self.refused[key] = str(exc) if isinstance(exc, _Refused) else _why_type(param, exc)
        self.capacity[key] = cap
        return cap

    @staticmethod
    def _agrees_with_fused(
        item: _Item, reference: Reference, small: Any, n: int, round_to: torch.dtype | None
    ) -> bool:
        """Whether the fused kernel writes the bytes the type's own write wrote: on the probe's
        ``n`` real blocks (``small`` holds them) and on crafted blocks where rules part."""
        if not fused.usable(item.reader, round_to, item.main):
            return False
        try:
            rounding = round_to is not None
            reader = reader_for(small)
            main = item.blocks.part(0, n).take(item.main, -item.start)
            if isinstance(reader, str) or fused.differing_bytes(main, reader, rounding):
                return False
            crafted = fused.crafted_rows(item.main.device)
            instance = reference._empty((crafted.shape[0], BLOCK), crafted.device)
            reference.write(instance, _rounded(crafted, round_to))
            reader = reader_for(instance)
            return not isinstance(reader, str) and fused.differing_bytes(crafted, reader, rounding) == 0
        except Exception:  # noqa: BLE001 - the type's own write path stays the reference
            return False

    def _flush_fused(self, batch: _Batch) -> None:
        """One kernel launch per item: TE's cast of the main blocks against the param's bytes.
        A batch it finds differing is judged again by the type's own write (``_attribute``)."""
        slot = self._flag_of[id(batch)]
        flags, rounding = self._flags, batch.round_to is not None
        assert flags is not None
        for it in batch.items:
            fused.compare(it.main, -it.start, it.reader, it.blocks, rounding, flags, slot)
        self.verdicts.append((batch, flags[slot]))

    def _new_flags(self) -> None:
        """Zeroed counters for this call's fused batches (inside a capture: in the graph's pool)."""
        batches = [b for b in self.planned if b.key in self.fused and b.key not in self.refused]
        self._flag_of = {id(b): i for i, b in enumerate(batches)}
        self._flags = None
        if batches:
            device = batches[0].items[0].main.device
            self._flags = torch.zeros(len(batches), dtype=torch.int32, device=device)

    def _main_rows(self, batch: _Batch) -> torch.Tensor:
        """The batch's main blocks as the gather delivers them, ``(k, 32)`` contiguous, zero
        rows appended up to whole 32-row tiles (TE quantizes whole tiles; a zero row is a block
        of its own): one rounding copy per param."""
        items = batch.items
        if len(items) == 1 and batch.blocks % BLOCK == 0:
            it = items[0]
            return _rounded(it.want(), batch.round_to).contiguous()
        rows = _padded_rows(items[0].main, batch.blocks, batch.round_to)
        # One cat into the rounded rows (the copies loop in C++, not here).
        torch.cat([it.want() for it in items], out=rows[: batch.blocks])
        return rows

    def _got_bytes(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _flush_codes(self, batch: _Batch) -> None:
        """Codes and scale bytes of the reference against the param's: equal bytes are equal
        values. A batch with differing bytes is compared by value in ``finish`` (a checkpoint
        load re-quantizes about 5% of blocks to other bytes with the same values)."""
        rows = self._main_rows(batch)
        codes, scales = self.references[batch.key].codes(rows, batch.blocks)
        del rows
        got_codes, got_scales = self._got_bytes(batch)
        self.verdicts.append((batch, _differ(codes, got_codes)))
        self.verdicts.append((batch, torch.ne(scales, got_scales).any()))

    def _seal(self, key: tuple[Any, ...]) -> None:
        batch = self.batches.pop(key, None)
        if batch is not None and batch.items:
            self.planned.append(batch)

    def _compare(self, batch: _Batch) -> None:
        """Compare one batch; the verdict stays on the device (no host sync per batch)."""
        if batch.items[0].mxfp8_codes:
            if id(batch) in self._flag_of:
                self._flush_fused(batch)
            else:
                self._flush_codes(batch)
            return
        got, want, small = self._sides(batch)
        if small is not None and batch.key not in self.trusted:
            reason = self_check(self.references[batch.key], small, want)
            if reason:
                raise _Refused(reason)
            self.trusted.add(batch.key)
        if self.atol:
            differs = ~((got.float() - want.float()).abs() <= self.atol).all()
        else:
            differs = (got != want).any()  # NaN counts as a difference
        self.verdicts.append((batch, differs))

    def _flush(self, batch: _Batch) -> None:
        try:
            self._compare(batch)
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            reason = str(exc) if isinstance(exc, _Refused) else _why(batch, exc)
            self.refused[batch.key], self.reusable = reason, False
            for it in batch.items:
                self.slots[it.slot].unchecked = reason

    def _run_eager(self) -> None:
        self._new_flags()
        for batch in self.planned:
            if batch.key not in self.refused:
                self._flush(batch)
                continue
            for it in batch.items:  # its type was refused by an earlier batch of this call
                self.slots[it.slot].unchecked = self.refused[batch.key]

    def _capturable(self) -> bool:
        """A plan's second run on a CUDA device, with every compare of the first one done."""
        if self.graph is not None or self.no_graph or self.runs < 1 or not self.reusable:
            return False
        if not self.planned or not self.planned[0].items[0].main.is_cuda:
            return False
        if os.environ.get("MXFP8_VERIFY_CUDA_GRAPH", "1") == "0":
            self.no_graph = "MXFP8_VERIFY_CUDA_GRAPH=0"
            return False
        if _GRAPHS_OFF:  # one failed capture turns them off for the process
            self.no_graph = _GRAPHS_OFF[0]
            return False
        return not torch.cuda.is_current_stream_capturing()

    def _capture(self) -> None:
        """Capture every compare of the plan as one CUDA graph and replay it.

        A reused plan reads the same tensors at the same addresses (``verify_weights`` keeps it
        only while they are unchanged), so its kernels can be replayed instead of launched one by
        one: the check then costs its GPU time, not the host's launch and Python time per batch
        (a full check of a 4B model has ~300 batches). The graphs share one memory pool, which
        holds one batch's intermediates (the budget) for as long as the plans are kept. Where the
        param type's write path cannot be captured (a host sync, a host-to-device copy), the
        reason is kept in ``no_graph`` and the plan runs eagerly."""
        for reference in self.references.values():
            reference.release()  # its instance is made inside the capture, in the graph's pool
        graph = torch.cuda.CUDAGraph()
        self.verdicts = []
        # Not ``torch.cuda.graph``: its entry empties the allocator's cache (and collects
        # garbage), which would cost the training job its cached blocks at every capture.
        stream, caller = _capture_stream(), torch.cuda.current_stream()
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=_graph_pool(), capture_error_mode="thread_local")
                try:
                    self._new_flags()
                    for batch in self.planned:
                        self._compare(batch)
                    stacked = torch.stack([v for _, v in self.verdicts])
                finally:
                    graph.capture_end()
            caller.wait_stream(stream)
        except Exception as exc:  # noqa: BLE001 - eager compares judge the same
            caller.wait_stream(stream)
            _end_allocating_to_pool()
            self.no_graph = f"not capturable ({type(exc).__name__}: {exc})"
            _GRAPHS_OFF.append(self.no_graph)
            self.verdicts = []
            for reference in self.references.values():
                reference.release()
            self._run_eager()
            return
        self.graph = graph
        self.graph_verdicts = [(batch, stacked[i]) for i, (batch, _) in enumerate(self.verdicts)]
        graph.replay()
        self.verdicts = list(self.graph_verdicts)

    def finish(self, max_names: int) -> None:
        """Flush what is left, read every batch's verdict in one transfer, attribute the
        differences of a failed batch to its params (recomputed: the failure path only), and fill
        the report."""
        for key in list(self.batches):
            self._seal(key)
        if self.graph is not None:
            self.graph.replay()
            self.verdicts = list(self.graph_verdicts)
        elif self._capturable():
            self._capture()
        else:
            self._run_eager()
        self.runs += 1
        for reference in self.references.values():
            reference.release()
        if self.verdicts:
            failed = torch.stack([d for _, d in self.verdicts]).tolist()
            done: set[int] = set()
            for (batch, _), bad in zip(self.verdicts, failed, strict=True):
                if bad and id(batch) not in done:
                    done.add(id(batch))
                    self._attribute(batch)
        self._tally(max_names)

    def _attribute_codes(self, batch: _Batch) -> None:
        """Values of a batch whose bytes differ, param by param, a bounded chunk at a time."""
        cap = self.written.get(batch.key, batch.blocks)
        if batch.blocks > cap:  # a fused batch: judged by the type's write in budget-sized parts
            for part in _split(batch, cap):
                self._attribute_codes(part)
            return
        rows = self._main_rows(batch)
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
                self._count(it.slot, got, want)
            r += it.blocks.count
        reference.release()

    def _attribute(self, batch: _Batch) -> None:
        if batch.items[0].mxfp8_codes:
            self._attribute_codes(batch)
            return
        got, want, _ = self._sides(batch)
        row = 0
        for it in batch.items:
            rows = it.blocks.count + (it.tail is not None)
            self._count(it.slot, got[row : row + rows], want[row : row + rows])
            row += rows

    def _count(self, slot_id: int, g: torch.Tensor, w: torch.Tensor) -> None:
        if g.numel() == 0 or torch.equal(g, w):
            return
        diff = (g.float() - w.float()).abs()
        count = int((~(diff <= self.atol)).sum())  # NaN counts as a difference
        slot = self.slots[slot_id]
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
            params = {s for b, _ in self.verdicts if b.key == key for s in (it.slot for it in b.items)}
            count = len(params) + self.empty.get(key, 0)
            if key not in self.refused and count:
                how = ", compared by the fused TE-rule kernel" if key in self.fused else ""
                report.count_path(f"{reference.path}, read {key[-1]}{how}", count)


def _split(batch: _Batch, cap: int) -> list[_Batch]:
    """``batch`` as batches of at most ``cap`` blocks (items split where they cross a border)."""
    parts = [_Batch(batch.key, batch.param, batch.mxfp8, batch.round_to)]
    for it in batch.items:
        lo = 0
        while lo < it.blocks.count:
            if parts[-1].blocks >= cap:
                parts.append(_Batch(batch.key, batch.param, batch.mxfp8, batch.round_to))
            take = min(cap - parts[-1].blocks, it.blocks.count - lo)
            parts[-1].items.append(_Item(it.slot, it.reader, it.main, it.start, it.blocks.part(lo, take),
                                         None, it.mxfp8_codes))  # fmt: skip
            parts[-1].blocks += take
            lo += take
    return [p for p in parts if p.items]


def _rounded(main: torch.Tensor, round_to: torch.dtype | None) -> torch.Tensor:
    return main.to(round_to) if round_to is not None else main


def _padded_rows(main: torch.Tensor, k: int, round_to: torch.dtype | None) -> torch.Tensor:
    """An uninitialised ``(k, 32)`` batch of rows with zero rows up to a multiple of 32."""
    pad = (-k) % BLOCK
    rows = torch.empty((k + pad, BLOCK), dtype=round_to or main.dtype, device=main.device)
    if pad:
        rows[k:].zero_()
    return rows


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether any byte differs (0-d, on the device): 8 bytes per compare where the layout lets."""
    try:
        a, b = a.view(torch.int64), b.view(torch.int64)
    except RuntimeError:
        pass
    return torch.ne(a, b).any()


def _allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out so far (cumulative: no reset of anyone's peak)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("allocated_bytes.all.allocated", 0)) or None


_POOLS: dict[int, Any] = {}
#: Why captures are off for this process, once one failed: a failed capture may leave the
#: allocator routing the side stream's allocations to the pool, so no other is attempted.
_GRAPHS_OFF: list[str] = []


def _end_allocating_to_pool() -> None:
    """Undo what a failed capture may have left: the side stream allocating into the pool."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    device = torch.cuda.current_device()
    if end is not None and device in _POOLS:
        try:
            end(device, _POOLS[device])
        except Exception:  # noqa: BLE001, S110 - nothing was left to undo
            pass


_STREAMS: dict[int, Any] = {}


def _capture_stream() -> Any:
    """One side stream per device for every capture: the allocator reuses a freed block only on
    the stream it was allocated on, so a new stream per capture would grow the pool each time."""
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


def _graph_pool() -> Any:
    """One memory pool per device for every plan's graph: they replay one at a time, so each
    graph's intermediates may reuse another's (outputs stay referenced and are not reused)."""
    device = torch.cuda.current_device()
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


class _Refused(Exception):
    """The type's blocks cannot be read or referenced the way the type does it."""


def _why(batch: _Batch, exc: Exception) -> str:
    return _why_type(batch.param, exc)


def _why_type(param: Any, exc: Exception) -> str:
    return f"no same-type reference for {type(param).__name__} ({type(exc).__name__}: {exc})"
