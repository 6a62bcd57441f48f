"""A few captured batches, replayed for every batch of an own-write key.

A type's own write is a Python call of the type (an emulated one is ~15 torch calls), and
recording it into a CUDA graph costs about three times running it: a plan's first call that
recorded every batch of a full check (a few hundred at 4B) cost 3-7x the eval transition it is
set against, most of it recording. But the batches of one key differ only in data: which main
rows the gather reads and which codes the compare reads, both from a table (``fused.GatherLaunch``).
So the key's batch is recorded, its kernels reading their table and adding to their count at a
device-side batch index that the graph then steps, and replayed until every batch is done: the
first call records a few writes per key (``_GROUP`` batches in a row, and one for the rest), and
a later call costs a graph launch per group on the host, hidden behind the GPU's work.

The gather's buffer lives outside the graph's pool, zeroed once: a batch with fewer blocks than
the key's largest leaves rows of the one before it, which the write turns into codes nobody
compares (MXFP8 row-wise blocks are independent, so they change no compared row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import graphs
from ._tables import Segment, Tables
from .fused import GATHER_FIELDS, GatherLaunch, _offsets

__all__ = ["Template", "capture_all", "plan_templates", "replay_all"]

Written = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

_PROGRAM = GATHER_FIELDS.index("program")
#: A table row no program finds (its first program past any grid): pads a shorter segment.
_UNREACHED = 1 << 62
#: Batches per replay: each graph launch costs the GPU a gap (~10 us measured per batch on an
#: H100 with a launch each, against a plan's one graph), which 8 in a row share; recording 8
#: writes (and one for the rest) is still a few, not a few hundred.
_GROUP = 8


@dataclass
class Template:
    """The batches of one own-write key and the two recordings that serve them all (a group of
    batches in a row, and one batch for the rest)."""

    batches: list[Any]  # the key's batches, in the plan's order
    launch: GatherLaunch  # every batch's tables (``packed``), the one ``index`` names read
    packed: torch.Tensor  # (batches, segments, rows, fields): every batch's tables, rebased
    index: torch.Tensor  # (1,) int64: which batch the next replay compares
    rows: torch.Tensor  # the gather's buffer, kept outside the graph's pool
    counts: torch.Tensor  # (batches,) int32: each batch's differing bytes (its verdict)
    graph: Any = field(default=None)  # ``group`` batches in a row
    single: Any = field(default=None)  # one batch: the rest of the key's batches after the groups

    def record(self, written: Written, phase: torch.Tensor) -> torch.Tensor:
        """One batch, the one ``index`` names: gathered, written by the type (``written(rows,
        blocks)``: codes and scale bytes), compared into its count; then ``index`` moves on. The
        kernels read the table and add to the count at ``index`` themselves: a batch costs the
        gather, the write, the compare and the step, one small kernel more than in a plan's graph."""
        self.launch(phase, out=self.rows)
        codes, scales = written(self.rows, self.launch.blocks)
        self.launch.differing(codes, scales, phase, count=self.counts)
        self.index.add_(1)
        return self.counts

    @property
    def group(self) -> int:
        return min(_GROUP, len(self.batches))

    def capture(self, written: Written, phase: torch.Tensor, paths: Any) -> None:
        """Record ``group`` batches in a row, and one where the count leaves a rest
        (``graphs.capture``; raises ``graphs.Uncapturable``)."""
        self.index.zero_()
        self.graph, _ = graphs.capture(
            lambda: [self.record(written, phase) for _ in range(self.group)][-1], paths
        )
        if len(self.batches) % self.group:
            self.single, _ = graphs.capture(lambda: self.record(written, phase), paths)

    def reset(self) -> None:
        """Counts zeroed and the index back at the first batch: recorded at the head of the plan's
        graph, which replays before the templates (two host-launched fills per key, each a gap on
        the GPU between the plan's graph and the key's, cost more than the fills themselves)."""
        self.index.zero_()
        self.counts.zero_()

    def replay(self) -> None:
        """Every batch of the key, in order, into counts the plan's graph has just zeroed."""
        for _ in range(len(self.batches) // self.group):
            self.graph.replay()
        for _ in range(len(self.batches) % self.group):
            self.single.replay()

    def verdicts(self) -> list[tuple[Any, torch.Tensor]]:
        return [(batch, self.counts[i]) for i, batch in enumerate(self.batches)]


def capture_all(templates: Sequence[Template], references: dict[Any, Any], phase: Any, paths: Any) -> None:
    """Record each template's batches, written by its key's reference (raises
    ``graphs.Uncapturable``, after which none of them has a graph)."""
    try:
        for t in templates:
            written = references[t.batches[0].key].codes
            t.capture(written, phase.tensor(t.batches[0].items[0].main.device), paths)
    except graphs.Uncapturable:
        for t in templates:
            t.graph = t.single = None
        raise


def replay_all(templates: Sequence[Template]) -> None:
    for t in templates:
        t.replay()


def plan_templates(
    planned: Sequence[Any], launches: dict[int, Any], tables: Tables | None = None
) -> list[Template]:
    """A template per key with more than ``_GROUP`` batches that all have a ``GatherLaunch`` of
    one base (their addresses a whole number of elements from the first batch's), made at plan
    time from the launches' tables while they are still on the host; other batches stay in the
    plan's graph. A key of ``_GROUP`` batches or fewer records as many writes either way, and in
    the plan's graph it costs no graph launch and fills of its own; but a launch's host time grows
    with its graph's nodes, so that cost mostly moves into the plan's graph's launch (at 1B, side by
    side: 0.97-1.04x at 1/16, 0.91x at 1/64; docs/verify.md). A templated batch's own launch
    leaves ``launches`` and its table ``tables`` unsent: its rows are in the template's table, and
    nothing launches it alone (a full 4B check's plan: a few thousand tables sent for nothing)."""
    by_key: dict[Any, list[Any]] = {}
    for batch in planned:
        if isinstance(launches.get(id(batch)), GatherLaunch):
            by_key.setdefault(batch.key, []).append(batch)
    made = []
    for group in by_key.values():
        if _templated(len(group)):
            one = _template([launches[id(b)] for b in group], group)
            if one is not None:
                made.append(one)
    unsent = [s for t in made for b in t.batches for s in launches.pop(id(b)).segments]
    if tables is not None:
        tables.discard(unsent)
    return made


def _templated(batches: int) -> bool:
    """Whether a key of ``batches`` own-write batches gets a template (the benchmark sets it
    against the old rule, any key of two or more, side by side)."""
    return batches > _GROUP


def _template(launches: list[GatherLaunch], group: list[Any]) -> Template | None:
    first = launches[0]
    bases = (first.main, first.codes, first.scales)
    shifts = []
    for launch in launches:
        if (launch.rows_dtype, launch.round_bf16) != (first.rows_dtype, first.round_bf16):
            return None
        shift = _offsets(zip((launch.main, launch.codes, launch.scales), bases, strict=True))
        if shift is None:  # another dtype or device, or not a whole number of elements away
            return None
        shifts.append(shift)
    width = len(GATHER_FIELDS)
    segs = max(len(launch.segments) for launch in launches)
    table_rows = max(s.rows for launch in launches for s in launch.segments)
    dead = [0] * width  # a padding row: no blocks, mod, step, per_row and scale_cols 1
    dead[GATHER_FIELDS.index("mod") :] = [1] * (width - GATHER_FIELDS.index("mod"))
    dead[_PROGRAM] = _UNREACHED
    missing = list(dead)  # a missing segment: one row of no blocks that every program finds
    missing[_PROGRAM] = 0
    programs = [1] * segs
    flat: list[int] = []  # (batches, segments, rows, fields), built as Python ints: one tensor
    for launch, (main, codes, scales) in zip(launches, shifts, strict=True):
        div = launch.off_div  # its main and codes offsets are stored divided: multiplied back
        for s in range(segs):
            seg = launch.segments[s] if s < len(launch.segments) else None
            held = seg.host if seg is not None else [missing]
            assert held is not None  # a launch's host rows: made before the plan's tables are sent
            for row in held:  # each batch's addresses rebased onto the first batch's tensors
                flat += (row[0] * div + main, row[1] * div + codes, row[2] + scales)
                flat += row[3:]
            flat += dead * (table_rows - len(held))
            if seg is not None:
                programs[s] = max(programs[s], seg.programs)
    off_div = _divide_columns(flat, width)
    device = first.main.device
    packed = torch.tensor(flat, dtype=torch.int64).view(len(launches), segs, table_rows, width).to(device)
    segments = tuple(
        Segment(packed[0, s], table_rows, programs[s], first.segments[0].bound) for s in range(segs)
    )
    blocks = max(launch.blocks for launch in launches)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    launch = replace(
        first, segments=segments, blocks=blocks, batch=index, batch_stride=packed[0].numel(), off_div=off_div
    )
    rows = torch.zeros((blocks + (-blocks) % 32, 32), dtype=first.rows_dtype, device=device)
    counts = torch.zeros(len(group), dtype=torch.int32, device=device)
    return Template(list(group), launch, packed, index, rows, counts)


def _divide_columns(flat: list[int], width: int, divisor: int = 16) -> int:
    """``fused._divide_offsets`` over rows packed flat: the main and codes columns (0 and 1) of
    rows of ``width`` fields divided by ``divisor`` where they all divide by it."""
    columns = flat[0::width], flat[1::width]
    if any(x % divisor for column in columns for x in column):
        return 1
    flat[0::width] = [x // divisor for x in columns[0]]
    flat[1::width] = [x // divisor for x in columns[1]]
    return divisor
