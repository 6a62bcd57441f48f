"""A fused cast-and-compare for MXFP8 params whose write follows Transformer Engine's rule.

The shard check's reference is each type's own write path: per batch, the main blocks are rounded
into a bf16 buffer, written into a small instance of the type, and its bytes compared with the
param's. That moves about 11 bytes per element through memory and costs ~8 kernels per batch; a
full check then costs about as much as an eval transition. One kernel that reads the main shard
and the param's codes and scales once (5 bytes per element, nothing allocated) does it at the
memory floor, but it applies *a* rule, TE's, not the type's. A batch is one launch
(``Launch``: its items' addresses and geometry are tables made at plan time), not one per param:
at a sampled check the launches, not the data, were what the GPU time went to.

So it is used for a batch key only after it has agreed with the type's own write, byte for byte,
on the key's probe rows (the first real blocks, written by the type at plan time) and on crafted
blocks where scale rules part (amax mantissas past 1.75, powers of two, ties, E4M3 subnormals,
zeros, tiny and huge amax). A type with another rule (the OCP spec's, a swizzled layout, E5M2)
fails that and keeps its own write path. A batch the kernel finds differing is judged again
through the type's own write (the attribution path), so the kernel can never name a param
``WRONG`` by itself; it only answers "equal" quickly.

Plain params (values, not codes) get the same treatment (``ValuesLaunch``): one launch per batch
compares every item's sampled runs with the main shard's, rounded as the gather delivers them and
cast to the param's dtype, and counts the differing elements, where per param a captured check
made two gathers, a cat and a compare. A flagged batch is attributed on the old path.

On CPU (and where Triton is missing) nothing changes. ``MXFP8_VERIFY_FUSED=0`` turns the TE-rule
judge off: every MXFP8 batch is then judged by the type's own write, as for a type the kernel
refuses, and the kernels that only move or compare bytes (``GatherLaunch``, ``ValuesLaunch``)
stay on, as they are for such a type. ``MXFP8_VERIFY_TRITON=0`` turns every kernel here off (the
eager torch path). With ``TRITON_INTERPRET=1`` set before Triton is imported they run on CPU
tensors in Triton's interpreter (the tests do that).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _tables
from ._tables import Segment, Tables
from .read import BLOCK, Blocks, Reader

__all__ = [
    "GATHER_FIELDS",
    "ITEM_FIELDS",
    "VALUE_FIELDS",
    "GatherLaunch",
    "Launch",
    "Segment",
    "Tables",
    "ValuesLaunch",
    "available",
    "compare",
    "gather_launch",
    "launch",
    "values_launch",
]

_MAX_NORM_RCP = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()
_BLOCKS_PER_PROGRAM = 64


def available(device: torch.device) -> bool:
    """Whether this module's kernels can run on ``device`` here."""
    if os.environ.get("MXFP8_VERIFY_TRITON", "1") == "0" or not _triton_installed():
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _triton_installed() -> bool:
    """Asked once per process (a plan asks ``available`` per batch: a few thousand at a full 4B
    check); the switches stay live."""
    return importlib.util.find_spec("triton") is not None


def usable(reader: Reader, round_to: torch.dtype | None, main: torch.Tensor) -> bool:
    """Whether a batch key's layout is one the kernel reads: E4M3 codes, one byte per element,
    unswizzled scale bytes, and a main shard delivered as bf16 or cast from fp32 directly; and
    whether the TE-rule judge is on (``MXFP8_VERIFY_FUSED``)."""
    return (
        os.environ.get("MXFP8_VERIFY_FUSED", "1") != "0"
        and reader.scales is not None
        and reader.element == torch.float8_e4m3fn
        and round_to in (None, torch.bfloat16)
        and main.dtype in (torch.float32, torch.bfloat16)
        and available(main.device)
    )


def compare(
    main: torch.Tensor,
    base: int,
    reader: Reader,
    blocks: Blocks,
    round_bf16: bool,
    flags: torch.Tensor,
    flag: int,
    phase: torch.Tensor,
) -> None:
    """Add to ``flags[flag]`` the bytes (codes and scales) of ``blocks`` of the param that differ
    from TE's cast of the main shard's blocks (param element ``i`` at ``main[base + i]``). The
    sampled phase is read from ``phase`` (0-d int64, on the device) by the kernel, so a captured
    launch serves every phase (``sampling.Phased``). One launch, no allocation, no host sync:
    capturable in a CUDA graph."""
    if blocks.count == 0:
        return
    from ._te_rule_kernel import kernel

    assert reader.scales is not None
    start, lo, count, n, mod, step = blocks.kernel_args()
    grid = (-(-count // _BLOCKS_PER_PROGRAM),)
    base_div = 16 if base % 16 == 0 else 1
    last_div = BLOCK if blocks.last % BLOCK == 0 else 1
    kernel[grid](
        main, reader.flat, reader.scales, flags, flag, phase,
        base // base_div, start, lo, count, n, mod, step, blocks.last // last_div, blocks.per_row,
        reader.scale_cols, _MAX_NORM_RCP,
        ROUND_BF16=round_bf16, BLOCKS=_BLOCKS_PER_PROGRAM, BASE_DIV=base_div, LAST_DIV=last_div,
    )  # fmt: skip


#: A row of a batch's item table, in the order the kernel reads it (``_te_cast_compare_items``):
#: offsets from the first item's main shard and codes (elements, divided by the launch's
#: ``off_div``) and scales (bytes), the item's first program, then its ``Blocks.kernel_args``,
#: ``last`` (divided by ``last_div``), ``per_row`` and the scales' row length.
ITEM_FIELDS = ("main", "codes", "scales", "program", "start", "lo", "count", "n", "mod", "step", "last",
               "per_row", "scale_cols")  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """A batch's compares as one launch. Launched per item, a sampled check of a 1B model was
    ~60 launches whose fixed cost was most of its GPU time (its data is ~75 us at HBM
    bandwidth). The items' addresses and geometry are data here, in tables made at plan time
    (a capture cannot make them: it would record their copy, not their values), valid for as
    long as the plan's tensors keep their addresses, which is as long as a plan is kept."""

    main: torch.Tensor  # the first item's: every address is an offset from these
    codes: torch.Tensor
    scales: torch.Tensor
    segments: tuple[Segment, ...]  # the item table (``ITEM_FIELDS``)
    off_div: int
    last_div: int
    round_bf16: bool

    def __call__(self, flags: torch.Tensor, flag: int, phase: torch.Tensor) -> None:
        """Add the batch's differing bytes to ``flags[flag]``, at the phase ``phase`` holds. No
        allocation, no host sync: capturable."""
        from ._te_rule_kernel import items_kernel

        for seg in self.segments:
            items_kernel[seg.grid](
                self.main, self.codes, self.scales, flags, flag, phase, seg.items, seg.rows, _MAX_NORM_RCP,
                ROUND_BF16=self.round_bf16, BLOCKS=_BLOCKS_PER_PROGRAM, OFF_DIV=self.off_div,
                LAST_DIV=self.last_div, ROWS=seg.bound,
            )  # fmt: skip


def launch(items: Sequence[Any], round_bf16: bool, tables: Tables | None = None) -> Launch | None:
    """One launch for a batch's ``items`` (``batches.Item``: main shard, shard start, reader,
    blocks), or None where they cannot share one: main shards of two dtypes or devices, or an
    address that is no whole element away from the first item's (then a launch per item)."""
    first = items[0]
    assert first.reader.scales is not None
    tensors = (first.main, first.reader.flat, first.reader.scales)
    rows: list[list[int]] = []
    chunks: list[int] = []  # programs per row (``_tables.segments`` writes each row's first program)
    for it in items:
        offsets = _offsets(zip((it.main, it.reader.flat, it.reader.scales), tensors, strict=True))
        if offsets is None:
            return None
        start, lo, count, n, mod, step = it.blocks.kernel_args()
        rows.append([offsets[0] - it.start, *offsets[1:], 0, start, lo, count, n, mod, step,
                     it.blocks.last, it.blocks.per_row, it.reader.scale_cols])  # fmt: skip
        chunks.append(-(-count // _BLOCKS_PER_PROGRAM))
    if not sum(chunks):
        return None
    off_div = _divide_offsets(rows, (0, 1))
    last_div = _divide_offsets(rows, (10,), BLOCK)
    segments = _tables.segments(rows, chunks, ITEM_FIELDS.index("program"), first.main.device, tables)
    return Launch(*tensors, segments, off_div, last_div, round_bf16)


#: A row of a values batch's item table (``_values_kernel``): offsets of the item's run 0 from the
#: first item's param values and main shard (elements, divided by the launch's ``off_div``), its
#: first program, its ``Blocks.kernel_args``, and its short tail run (``Item.tail``): offsets from
#: the same two tensors and its length (0: none).
VALUE_FIELDS = ("got", "main", "program", "start", "lo", "count", "n", "mod", "step", "tail_got", "tail_main",
                "tail")  # fmt: skip
#: How the kernel rounds the main shard's values (``_values_kernel.NONE, BF16, FP16``): a dtype
#: not here (fp64, FP8) keeps the batch on the gathers.
_ROUNDING = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class ValuesLaunch:
    """A values batch's compares as one launch (``_values_kernel``): every item's sampled runs
    and tail, the main rounded to ``round_to`` then cast to the param's dtype as ``batches.sides``
    does, exactly or within ``atol``. Its tables are made at plan time, as ``Launch``'s are."""

    got: torch.Tensor  # the first item's param values and main shard: offsets are from these
    main: torch.Tensor
    segments: tuple[Segment, ...]  # the item table (``VALUE_FIELDS``)
    off_div: int
    round_to: int
    cast: int
    atol: float

    def __call__(self, flags: torch.Tensor, flag: int, phase: torch.Tensor) -> None:
        """Add the batch's differing elements to ``flags[flag]``, at the phase ``phase`` holds.
        No allocation, no host sync: capturable."""
        from ._values_kernel import items_kernel

        for seg in self.segments:
            items_kernel[seg.grid](
                self.got, self.main, flags, flag, phase, seg.items, seg.rows, self.atol,
                ROUND=self.round_to, CAST=self.cast, ATOL=bool(self.atol), BLOCKS=_BLOCKS_PER_PROGRAM,
                OFF_DIV=self.off_div, GOT_BF16=self.got.dtype == torch.bfloat16,
                MAIN_BF16=self.main.dtype == torch.bfloat16, ROWS=seg.bound,
            )  # fmt: skip


def values_launch(
    items: Sequence[Any],
    round_to: torch.dtype | None,
    dtype: torch.dtype,
    atol: float,
    tables: Tables | None = None,
) -> ValuesLaunch | None:
    """One launch for a values batch's ``items`` (param dtype ``dtype``), or None where the
    kernel does not read them: no kernel on their device, codes, a dtype it does not round, or
    param values (or main shards) of two dtypes or devices."""
    first = items[0]
    got0, main0 = first.reader.flat, first.main
    if dtype not in _ROUNDING or round_to not in _ROUNDING or main0.dtype not in _ROUNDING:
        return None
    if got0.dtype != dtype or got0.device != main0.device or not available(got0.device):
        return None
    rows: list[list[int]] = []
    chunks: list[int] = []  # programs per row (``_tables.segments`` writes each row's first program)
    for it in items:
        if it.reader.scales is not None or it.mxfp8_codes or not it.blocks.aligned:
            return None
        tail = it.tail[0].numel() if it.tail is not None else 0
        pairs = [(it.reader.flat, got0), (it.main, main0)]
        pairs += [(it.tail[0], got0), (it.tail[1], main0)] if it.tail is not None else []
        offsets = _offsets(pairs)
        if offsets is None:
            return None
        got, main, tail_got, tail_main = offsets if it.tail is not None else [*offsets, 0, 0]
        origin = it.blocks.origin  # run g of the item: param elements origin + 32 g ..
        rows.append([got + origin, main + origin - it.start, 0, *it.blocks.kernel_args(),
                     tail_got, tail_main, tail])  # fmt: skip
        chunks.append(max(-(-it.blocks.count // _BLOCKS_PER_PROGRAM), int(tail > 0)))
    if not sum(chunks):
        return None
    off_div = _divide_offsets(rows, (0, 1))
    segments = _tables.segments(rows, chunks, VALUE_FIELDS.index("program"), got0.device, tables)
    rounds = _ROUNDING[round_to], _ROUNDING[dtype]
    return ValuesLaunch(got0, main0, segments, off_div, *rounds, atol)


#: A row of an own-write batch's gather table (``_gather_kernel``): offsets from the first item's
#: main shard (less the item's start) and codes (elements, divided by the launch's ``off_div``)
#: and scales (elements), its first program, its first
#: row in the batch's buffers, its ``Blocks.kernel_args``, ``per_row`` and the scales' row length.
GATHER_FIELDS = ("main", "codes", "scales", "program", "out", "start", "lo", "count", "n", "mod", "step",
                 "per_row", "scale_cols")  # fmt: skip
#: (main dtype, rows dtype) -> whether the gather rounds fp32 to bf16 on the way.
_GATHER_CASTS = {(torch.float32, torch.float32): False, (torch.bfloat16, torch.bfloat16): False,
                 (torch.float32, torch.bfloat16): True}  # fmt: skip


@dataclass(frozen=True)
class GatherLaunch:
    """An own-write batch's gather and compare as one launch each (``_gather_kernel``): the main
    rows ``batches.main_rows`` makes, at the phase a tensor holds, and the count of the written
    codes and scale bytes that differ from the param's (what ``batches.got_bytes`` and two
    compares gave). Its tables are made at plan time, as ``Launch``'s are; the buffers at each
    call (in a capture: the pool)."""

    main: torch.Tensor  # the first item's main shard, codes and scales, as integers of their width
    codes: torch.Tensor
    scales: torch.Tensor
    segments: tuple[Segment, ...]  # the item table (``GATHER_FIELDS``); a last row of n = 0: the zero rows
    blocks: int
    rows_dtype: torch.dtype
    round_bf16: bool
    #: which table of ``segments`` a launch reads (int64 ``(1,)``), and the tables' distance in
    #: elements: a template's (``_templates``); a batch's own is ``[0]`` and ``0``
    batch: torch.Tensor
    batch_stride: int = 0
    off_div: int = 1  # the main and codes offsets are stored divided by it (``_divide_offsets``)

    def __call__(self, phase: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The main rows ``(k + pad, 32)``, rounded as the gather delivers them (into ``out``
        where given: a template's buffer)."""
        from ._gather_kernel import items_kernel

        k, device = self.blocks, self.main.device
        rows = (
            out
            if out is not None
            else torch.empty((k + (-k) % BLOCK, BLOCK), dtype=self.rows_dtype, device=device)
        )
        bits = torch.int16 if self.rows_dtype.itemsize == 2 else torch.int32
        for seg in self.segments:
            items_kernel[seg.grid](
                self.main, rows.view(bits), phase, seg.items, seg.rows, self.batch, self.batch_stride,
                ROUND_BF16=self.round_bf16, BLOCKS=_BLOCKS_PER_PROGRAM, OFF_DIV=self.off_div, ROWS=seg.bound,
            )  # fmt: skip
        return rows

    def differing(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        phase: torch.Tensor,
        count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """How many of the written ``codes`` ``(k, 32)`` and scale bytes ``(k,)`` (any stride)
        differ from the param's at ``phase`` (0-d int32, on the device; added to ``count`` at
        ``batch`` where given: a template's counts)."""
        from ._gather_kernel import compare_kernel

        if count is None:
            count = torch.zeros((), dtype=torch.int32, device=self.main.device)
        for seg in self.segments:
            compare_kernel[seg.grid](
                self.codes, self.scales, codes.view(torch.uint8), scales.view(torch.uint8), scales.stride(0),
                count, phase, seg.items, seg.rows, self.batch, self.batch_stride,
                BLOCKS=_BLOCKS_PER_PROGRAM, OFF_DIV=self.off_div, ROWS=seg.bound,
            )  # fmt: skip
        return count


def gather_launch(
    items: Sequence[Any], round_to: torch.dtype | None, tables: Tables | None = None
) -> GatherLaunch | None:
    """One gather launch for an own-write batch's ``items`` (codes read), or None where the
    kernel does not read them (they keep ``main_rows`` and ``got_bytes``): no kernel on their
    device, a rounding it does not make, ragged rows, tensors of two dtypes or devices."""
    first = items[0]
    main0, codes0, scales0 = first.main, first.reader.flat, first.reader.scales
    cast = _GATHER_CASTS.get((main0.dtype, round_to or main0.dtype))
    if cast is None or scales0 is None or codes0.dtype != torch.uint8 or scales0.dtype != torch.uint8:
        return None
    if codes0.device != main0.device or scales0.device != main0.device or not available(main0.device):
        return None
    rows: list[list[int]] = []
    chunks: list[int] = []  # programs per row (``_tables.segments`` writes each row's first program)
    out = 0
    for it in items:
        if not it.mxfp8_codes or not it.blocks.aligned or it.tail is not None:
            return None
        offsets = _offsets([(it.main, main0), (it.reader.flat, codes0), (it.reader.scales, scales0)])
        if offsets is None:
            return None
        main, codes, scales = offsets
        rows.append([main - it.start, codes, scales, 0, out, *it.blocks.kernel_args(),
                     it.blocks.per_row, it.reader.scale_cols])  # fmt: skip
        chunks.append(-(-it.blocks.count // _BLOCKS_PER_PROGRAM))
        out += it.blocks.count
    if not sum(chunks):
        return None
    if out % BLOCK:  # the zero rows up to whole 32-row tiles
        rows.append([0, 0, 0, 0, out, 0, 0, (-out) % BLOCK, 0, 1, 1, 1, 1])
        chunks.append(1)
    bits = torch.int16 if main0.dtype.itemsize == 2 else torch.int32
    off_div = _divide_offsets(rows, (0, 1))
    segments = _tables.segments(rows, chunks, GATHER_FIELDS.index("program"), main0.device, tables)
    rows_dtype = round_to or main0.dtype
    own = (  # the index of its one table
        tables.zero(main0.device)
        if tables is not None
        else torch.zeros(1, dtype=torch.int64, device=main0.device)
    )
    return GatherLaunch(
        main0.view(bits), codes0, scales0, segments, out, rows_dtype, cast, own, off_div=off_div
    )


def _divide_offsets(rows: list[list[int]], columns: tuple[int, ...], divisor: int = 16) -> int:
    """``divisor`` where every row's ``columns`` divide by it (those columns then divided), else 1.
    The kernel multiplies them back by it as a constant: the compiler then knows a block's
    elements are 16-aligned and loads them as vectors (a loaded offset could be anything: a
    load per byte), without a compile per value as specializing on the integers would be."""
    if any(r[c] % divisor for r in rows for c in columns):
        return 1
    for r in rows:
        for c in columns:
            r[c] //= divisor
    return divisor


def _offsets(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[int] | None:
    """Elements from each base's first to its tensor's first, or None where any is not a whole
    number of elements away, or of another dtype or device (the three launch tables share this
    rule). One loop, no call per tensor: a plan's tables ask it of every item, three times."""
    found = []
    for tensor, base in pairs:
        if tensor.dtype is not base.dtype or tensor.device != base.device:
            return None
        step = tensor.element_size()
        diff = tensor.data_ptr() - base.data_ptr()
        if diff % step:
            return None
        found.append(diff // step)
    return found
