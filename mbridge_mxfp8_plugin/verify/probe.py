"""Probing a batch key (type, configuration, reader) once, before any of its batches is compared.

A key's first item is written through a small instance of its own type: that decides whether the
check may read the type's codes at all (they must decode to the type's own ``dequantize``),
whether the fused kernel may stand in for the type's write, and how many blocks fit the memory
budget. Doing it once per key, shared by every plan of a layout, keeps it off the per-call cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import fused
from ._crafted import crafted_rows
from .batches import Item, padded_rows, rounded
from .read import BLOCK, Blocks, Reader, reader_for
from .reference import PROBE_ROWS, Reference, make_reference, self_check

__all__ = ["Probed", "Refused", "differing_bytes", "why_type"]

#: Extra bytes per compared element at a batch's peak where values are compared (bf16 params,
#: value-holding MXFP8 types): both sides, the reference instance and its cast's temporaries
#: (about 19 with the kit's emulated cast), plus a margin.
BYTES_PER_ELEMENT = 32
#: Where codes and scales are compared (see ``ShardCheck._flush_codes``), the peak is the write:
#: the rounded main blocks (2 bytes, or 4 unrounded), the reference's codes and scales (1 + 1/8,
#: its scale rows padded to 4) and the write's own temporaries, measured per batch key on a CUDA
#: device (the caching allocator's cumulative count over a probe write: an upper bound of its
#: peak), else the kit's emulated cast's (13). The param's codes are never copied beside it (a
#: captured batch compares them where they lie: ``fused.GatherLaunch``). On one H200 a full 4B
#: check of the one-pass stand-in peaked at 5.1 bytes per element of its largest batch.
_DEFAULT_TRANSIENTS = 13.0
_REFERENCE = 1 + 1 / 8
#: Blocks per batch where the fused kernel compares (it allocates nothing): one launch per param
#: up to 128M elements, so an eager run costs few launches.
_FUSED_BLOCKS = 1 << 22
_MARGIN = 1.1
#: Measured write temporaries per element, per type, configuration and quantizer function (a
#: process-wide cache: reading the allocator's statistics costs a few hundred microseconds).
_TRANSIENTS: dict[tuple[Any, ...], float] = {}


class Refused(Exception):
    """The type's blocks cannot be read or referenced the way the type does it."""


def why_type(param: Any, exc: Exception) -> str:
    return f"no same-type reference for {type(param).__name__} ({type(exc).__name__}: {exc})"


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

    def probe(
        self, key: tuple[Any, ...], param: Any, item: Item, round_to: torch.dtype | None, budget: int
    ) -> int:
        """Blocks per batch of ``key``, from the budget. For codes, a probe write of the first
        blocks (at most ``PROBE_ROWS``) checks the reading against the type's own
        ``dequantize`` (else the key is refused) and measures the write's temporaries."""
        cap = max(BLOCK, budget // (BYTES_PER_ELEMENT * BLOCK))
        if not item.mxfp8_codes:
            self.capacity[key] = cap
            return cap
        try:
            reference = self.references[key] = make_reference(param)
            n = min(item.blocks.count, PROBE_ROWS)
            main = item.blocks.part(0, n).take(item.main, -item.start)
            # Where the fused kernel could stand in, the gate's crafted blocks ride in the same
            # write (one write of the type per key: on an H100's host each was a millisecond of
            # small launches, the plan's first call's largest part after the walk).
            gate = _gate_rows(main, item, round_to)
            try:
                small, rows, transients = self._write(key, reference, main, gate, round_to)
            except Exception:  # noqa: BLE001 - a type may refuse the crafted extremes: its own first
                if gate is None:  # blocks alone, as the check reads them, decide whether it is trusted
                    raise
                gate = None
                small, rows, transients = self._write(key, reference, main, gate, round_to)
            if not hasattr(small, "dequantize"):
                raise Refused(f"{type(small).__name__} has no dequantize() to check its reading against")
            with torch._C.DisableTorchFunctionSubclass():
                want = torch.Tensor.to(small.dequantize(), param.dtype)[:n]
            reason = self_check(reference, small, want)
            if reason:
                raise Refused(reason)
            self.trusted.add(key)
            per_element = _MARGIN * (rows.element_size() + _REFERENCE + transients) + 0.25
            cap = max(BLOCK, int(budget / (per_element * BLOCK)) // BLOCK * BLOCK)
            if gate is not None and _agrees_with_fused(gate, small, round_to):
                # The kernel allocates nothing: its batches are bounded only so that a flagged
                # one is judged again by the type's write a budget-sized part at a time.
                self.fused.add(key)
                self.written[key] = cap
                cap = max(cap, _FUSED_BLOCKS)
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            self.refused[key] = str(exc) if isinstance(exc, Refused) else why_type(param, exc)
        self.capacity[key] = cap
        return cap

    def _write(
        self,
        key: tuple[Any, ...],
        reference: Reference,
        main: torch.Tensor,
        gate: torch.Tensor | None,
        round_to: torch.dtype | None,
    ) -> tuple[Any, torch.Tensor, float]:
        """A small instance of the key's type written from the probe's rows (the first blocks,
        zero rows up to a multiple of 32, then the gate's crafted blocks where there are any),
        the rows, and the write's temporaries per element (measured once per key and device)."""
        rows = _first_rows(main, round_to) if gate is None else rounded(gate, round_to)
        small = reference._empty((rows.shape[0], BLOCK), rows.device)
        update = getattr(type(reference.quantizer), "update_quantized", None)
        measured = key + (rows.device, reference.path, update)
        known = _TRANSIENTS.get(measured)
        before = _allocated(rows.device) if known is None else None
        reference.write(small, rows)
        after = _allocated(rows.device) if before is not None else None
        transients = _DEFAULT_TRANSIENTS if known is None else known
        if before is not None and after is not None:
            transients = _TRANSIENTS[measured] = (after - before) / rows.numel()
        return small, rows, transients


def _first_rows(main: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The probe's first blocks (``main``, ``(n, 32)``) in ``dtype`` (None: theirs), zero rows up
    to a multiple of 32."""
    rows = padded_rows(main, main.shape[0], dtype)
    rows[: main.shape[0]].copy_(main)
    return rows


def _gate_rows(main: torch.Tensor, item: Item, round_to: torch.dtype | None) -> torch.Tensor | None:
    """What the fused kernel's gate compares, or None where the kernel cannot stand in for the
    key: the probe's first blocks (unrounded: the kernel rounds as the gather does), zero rows
    up to a multiple of 32, then blocks where MXFP8 scale and rounding rules part (``_crafted``,
    bf16-exact): the key's type writes the same rows once, and the kernel must write the same
    bytes for every one of them."""
    if not fused.usable(item.reader, round_to, item.main):
        return None
    return torch.cat([_first_rows(main, None), crafted_rows(main.device).to(main.dtype)])


def _agrees_with_fused(gate: torch.Tensor, small: Any, round_to: torch.dtype | None) -> bool:
    """Whether the fused kernel writes the bytes the type's own write wrote (``small``) for
    every row of ``gate``: one kernel launch and one read."""
    try:
        reader = reader_for(small)
        return not isinstance(reader, str) and differing_bytes(gate, reader, round_to is not None) == 0
    except Exception:  # noqa: BLE001 - the type's own write path stays the reference
        return False


def differing_bytes(rows: torch.Tensor, reader: Reader, round_bf16: bool) -> int:
    """Bytes of an instance read by ``reader`` (holding ``rows``, ``(k, 32)``, as written by its
    own type) that differ from the kernel's cast of ``rows``: 0 means the kernel agrees with the
    type there. Syncs (plan time only)."""
    rows = rows.contiguous()
    flags = torch.zeros(1, dtype=torch.int32, device=rows.device)
    blocks = Blocks(last=BLOCK, start=0, count=rows.shape[0], step=1)
    phase = torch.zeros((), dtype=torch.int64, device=rows.device)
    fused.compare(rows.reshape(-1), 0, reader, blocks, round_bf16, flags, 0, phase)
    return int(flags.item())


def _allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out so far (cumulative: no reset of anyone's peak)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("allocated_bytes.all.allocated", 0)) or None
