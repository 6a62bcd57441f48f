"""Which blocks a sampled check compares: integer arithmetic over block ids, on the host and
on the device.

Kept apart from the checks that use it so the shard check and the replica fold agree on one
rotation: a phase that depends on ``offset % stride`` only, so every block is visited within
``stride`` calls. The shard check's plan holds the phase as data (:class:`Phase`, a device
tensor filled before each run) and its blocks as :class:`Phased` geometry, whose indices are
computed on the device from it: one plan, and one captured CUDA graph, serve every phase. The
host arithmetic (``mxfp8_blocks``, ``runs``) is what the device's selection equals, and what the
report's per-phase element counts and the failure path's re-judge use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import MXFP8UsageError
from .read import BLOCK, Blocks, gather_ragged

__all__ = [
    "Phase",
    "Phased",
    "first_sampled",
    "mxfp8_blocks",
    "runs",
    "sampled_mxfp8",
    "sampled_runs",
    "stride_of",
]


def stride_of(sample: float) -> int:
    if not 0.0 < sample <= 1.0:
        raise MXFP8UsageError(f"verify sample must be in (0, 1], got {sample!r}")
    return max(1, round(1.0 / sample))


def first_sampled(offset: int, stride: int, blocks: int) -> int:
    """The first sampled block of ``blocks``: rotates with ``offset`` over ``min(stride, blocks)``
    phases, so every block is visited within ``stride`` calls and every param yields one. It
    depends on ``offset % stride`` only (the replica fold's rows rotate the same way); the shard
    check computes it on the device (``Phase.first``)."""
    return (offset % stride) % max(1, min(stride, blocks))


def _every(first: int, blocks: int, stride: int) -> int:
    return max(0, -(-(blocks - first) // stride))


def mxfp8_blocks(param: Any, s: int, e: int, offset: int, stride: int) -> tuple[Blocks, int]:
    """The sampled blocks lying wholly inside the shard ``[s, e)``, and the elements in all
    whole blocks there. A block straddling two ranks' shards has a scale this rank cannot
    compute, so it is skipped (and counted)."""
    last, g0, n, whole = _whole_blocks(param, s, e)
    first = first_sampled(offset, stride, n)
    return Blocks(last, g0 + first, _every(first, n, stride), stride), whole


def _whole_blocks(param: Any, s: int, e: int) -> tuple[int, int, int, int]:
    """The param's row length, the first global block id wholly inside ``[s, e)``, how many are,
    and the elements they hold."""
    last = param.shape[-1] if param.dim() > 0 else 1
    per_row = -(-last // BLOCK)
    # Whole blocks inside [s, e) form one range of global block ids (row * per_row + j).
    r, c = divmod(s, last)
    j = -(-c // BLOCK)
    g0 = r * per_row + j if j < per_row else (r + 1) * per_row
    r, c = divmod(e, last)
    g1 = max(g0, r * per_row + c // BLOCK)
    n = g1 - g0
    # Elements in whole blocks: each row's last block holds only ``last % 32``.
    short = 0 if last % BLOCK == 0 else (g1 // per_row - g0 // per_row) * (BLOCK - last % BLOCK)
    return last, g0, n, n * BLOCK - short


def runs(s: int, e: int, offset: int, stride: int) -> tuple[Blocks, int]:
    """Runs of 32 counted from the shard start (no scale: any grouping compares the same), and
    how many elements of the short run at the shard's end are compared too. That run is taken
    only where every run is, or where it is the only one, so a sampled check still skips it."""
    n = (e - s) // BLOCK
    first = first_sampled(offset, stride, n)
    blocks = Blocks(BLOCK, first, _every(first, n, stride), stride, origin=s)
    tail = (e - s) % BLOCK if stride == 1 or n == 0 else 0
    return blocks, tail


def sampled_mxfp8(param: Any, s: int, e: int, phase: Phase) -> tuple[Blocks, int]:
    """``mxfp8_blocks`` at whatever phase ``phase`` holds when the blocks are read."""
    last, g0, n, whole = _whole_blocks(param, s, e)
    return _phased(Blocks(last, g0, n, 1), phase), whole


def sampled_runs(s: int, e: int, phase: Phase) -> tuple[Blocks, int]:
    """``runs`` at whatever phase ``phase`` holds when the blocks are read."""
    n = (e - s) // BLOCK
    tail = (e - s) % BLOCK if phase.stride == 1 or n == 0 else 0
    return _phased(Blocks(BLOCK, 0, n, 1, origin=s), phase), tail


def _phased(whole: Blocks, phase: Phase) -> Blocks:
    """The sampled blocks of the ``whole`` range: static where there is one phase (or nothing)."""
    n, stride = whole.count, phase.stride
    if stride == 1 or n == 0:
        return Blocks(whole.last, whole.start, whole.count, stride, whole.origin)
    return Phased(whole.last, whole.start, -(-n // stride), stride, whole.origin, n=n, phase=phase)


class Phase:
    """A plan's sampled phase (``offset % stride``) as data: a 0-d int64 tensor per device,
    filled in place before each run, which every sampled block index of the plan is computed
    from on the device. A captured graph reads it at replay, so it serves every phase.

    Also holds what a run derives from it and shares between items (``first``: one remainder
    per distinct modulus), and the index ramps the items' indices are made of: made at plan time,
    never inside a capture (a tensor made there holds nothing until the graph replays), as long
    as the longest part of an item that is read on the device (a batch's blocks at most)."""

    def __init__(self, stride: int, offset: int = 0) -> None:
        self.stride = stride
        self.value = offset % stride
        self._held = self.value  # what the tensors hold (the next call's phase after ``advance``)
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._ramps: dict[torch.device, torch.Tensor] = {}
        self._run: dict[Any, torch.Tensor] = {}  # this run's remainders of the phase
        self._local: dict[Any, torch.Tensor] = {}  # the current batch's indices, by geometry
        self._reserved: dict[torch.device, int] = {}  # the most indices reserved per device
        self._slices: dict[tuple[int, int, int], tuple[Blocks, int]] = {}  # see ``slice``

    def set(self, offset: int) -> None:
        """The phase of the next run (a fill on the device where the tensors hold another: no
        sync)."""
        self.value = offset % self.stride
        self._fill(self.value)

    def advance(self) -> None:
        """Ready the tensors for the call after this one, queued behind this call's replay, which
        has read them: the default offset is the call count, so the next call's phase is this
        one's plus one, and its ``set`` then launches nothing before its replay (a fill launch
        is about 8 us of the host's, on the critical path there, hidden here under the GPU's
        work). Another offset is filled by its ``set`` as before. The host's ``value`` stays
        this call's: what is left of it (attribution, the counts) is host arithmetic."""
        self._fill((self.value + 1) % self.stride)

    def _fill(self, value: int) -> None:
        if value != self._held:
            self._held = value
            for tensor in self._tensors.values():
                tensor.fill_(value)

    def slice(self, param: Any, s: int, e: int) -> tuple[Blocks, int]:
        """``sampled_mxfp8`` of ``param``'s slice ``[s, e)`` (``param`` None: ``sampled_runs``),
        shared by the slices of one geometry (a model's layers; whole params at DP 1): a plan's
        first call otherwise redid the same arithmetic and objects per param. Immutable."""
        last = 0 if param is None else param.shape[-1] if param.dim() > 0 else 1
        known = self._slices.get((last, s, e))
        if known is None:
            made = sampled_runs(s, e, self) if param is None else sampled_mxfp8(param, s, e, self)
            known = self._slices[(last, s, e)] = made
        return known

    def reserve(self, device: torch.device, count: int) -> None:
        """Make the phase tensor and a ramp of at least ``count`` indices on ``device`` (plan time;
        nothing where as many were reserved there, as for most of a plan's params). A plan of
        one phase (``stride`` 1) needs no ramp: nothing computes indices from it (a full
        check's would hold 8 bytes per block of its largest batch, about 2 MiB)."""
        if count <= self._reserved.get(device, -1):
            return
        self._reserved[device] = count
        if device not in self._tensors:
            self._fill(self.value)  # the others hold this phase too (plan time: a run reads them)
            self._tensors[device] = torch.full((), self.value, dtype=torch.int64, device=device)
        if self.stride == 1:
            return
        ramp = self._ramps.get(device)
        if ramp is None or ramp.numel() < count:
            self._ramps[device] = torch.arange(
                max(count, 2 * (0 if ramp is None else ramp.numel())), device=device
            )

    def tensor(self, device: torch.device) -> torch.Tensor:
        return self._tensors[device]

    def begin(self) -> None:
        """A new run: what the last one derived from the phase is stale."""
        self._run, self._local = {}, {}

    def done(self) -> None:
        """A batch is compared: its items' indices are not read again in this run (kept, a whole
        plan's would hold 8 bytes per sampled block, in a captured graph's pool too)."""
        self._local = {}

    def first(self, device: torch.device, mod: int) -> torch.Tensor:
        """``first_sampled`` on the device: the phase modulo ``mod`` (0-d)."""
        key = (device, mod)
        if key not in self._run:
            self._run[key] = torch.remainder(self._tensors[device], mod)
        return self._run[key]

    def local(self, blocks: Phased, device: torch.device) -> torch.Tensor:
        """The sampled blocks' indices into their slice's whole blocks, for this run. Relative to
        the slice, so the params of one shape in a batch (a model's layers) share them: the
        per-param work is then the gathers alone."""
        key = (device, blocks.n, blocks.step, blocks.lo, blocks.count)
        kept = self._local.get(key)
        if kept is not None:
            return kept
        first = self.first(device, min(blocks.step, blocks.n))
        local = torch.add(first, self._ramps[device][: blocks.count], alpha=blocks.step)
        if blocks.lo:  # a later part of the item (the ramp is as long as a batch, not a param)
            local.add_(blocks.lo * blocks.step)
        if blocks.n > blocks.step and blocks.n % blocks.step and blocks.lo + blocks.count >= blocks.full:
            # At a phase past ``n % step`` the last index has no block: it reads the one before
            # it (a block of the same phase), so shapes stay fixed and no other block is read.
            local = torch.where(local >= blocks.n, local - blocks.step, local)
        self._local[key] = local
        return local

    def scale_index(self, blocks: Phased, device: torch.device, cols: int) -> torch.Tensor:
        """The sampled blocks' scale bytes in rows of ``cols`` (padded past ``per_row``), from
        the slice's first row: shared like ``local``."""
        c0, per_row = blocks.start % blocks.per_row, blocks.per_row
        key = (device, blocks.n, blocks.step, blocks.lo, blocks.count, c0, per_row, cols)
        kept = self._local.get(key)
        if kept is None:
            column = self.local(blocks, device) + c0
            kept = self._local[key] = (column // per_row) * cols + column % per_row
        return kept


@dataclass(frozen=True)
class Phased(Blocks):
    """Every ``step``-th of the ``n`` whole blocks from global block ``start``, from the one the
    phase selects (``first_sampled``): indices ``lo .. lo + count`` of them (a batch's part). The
    count is the most any phase has; at a phase with one block fewer, the missing one is read
    as its neighbour, which compares the same, and the report counts the phase's own elements
    (``at``)."""

    n: int = 0
    phase: Phase = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    lo: int = 0

    @property
    def full(self) -> int:
        """The most sampled blocks any phase has."""
        return -(-self.n // self.step)

    def part(self, lo: int, count: int) -> Phased:
        # Not ``dataclasses.replace``: a plan's first call makes one part per param and batch,
        # and replace costs several times a constructor.
        return Phased(self.last, self.start, count, self.step, self.origin, self.n, self.phase, self.lo + lo)

    def at(self, value: int) -> Blocks:
        """These blocks at phase ``value`` as host arithmetic: exactly that phase's blocks."""
        first = first_sampled(value, self.step, self.n)
        count = max(0, min(self.count, _every(first, self.n, self.step) - self.lo))
        return Blocks(self.last, self.start + first + self.lo * self.step, count, self.step, self.origin)

    @property
    def is_view(self) -> bool:
        return False

    def elements(self) -> int:
        return self.at(self.phase.value).elements()

    def take(self, flat: torch.Tensor, base: int = 0) -> torch.Tensor:
        local = self.phase.local(self, flat.device)
        if self.aligned:
            at = flat.storage_offset() + base + self.origin + self.start * BLOCK
            return flat.as_strided((self.n, BLOCK), (BLOCK, 1), at).index_select(0, local)
        return gather_ragged(flat, base, local + self.start, self.last)

    def take_scales(self, scales: torch.Tensor, cols: int) -> torch.Tensor:
        if cols == self.per_row:
            whole = scales.as_strided((self.n,), (1,), scales.storage_offset() + self.start)
            return whole.index_select(0, self.phase.local(self, scales.device))
        row, c0 = divmod(self.start, self.per_row)
        span = ((c0 + self.n - 1) // self.per_row) * cols + self.per_row
        rows = scales.as_strided((span,), (1,), scales.storage_offset() + row * cols)
        return rows.index_select(0, self.phase.scale_index(self, scales.device, cols))

    def kernel_args(self) -> tuple[int, int, int, int, int, int]:
        return self.start, self.lo, self.count, self.n, min(self.step, self.n), self.step
