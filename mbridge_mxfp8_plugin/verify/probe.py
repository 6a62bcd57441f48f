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
            rows = padded_rows(item.main, n, round_to)
            rows[:n].copy_(item.blocks.part(0, n).take(item.main, -item.start))
            small = reference._empty((rows.shape[0], BLOCK), rows.device)
            update = getattr(type(reference.quantizer), "update_quantized", None)
            measured = key + (rows.device, reference.path, update)
            known = _TRANSIENTS.get(measured)
            before = _allocated(rows.device) if known is None else None
            reference.write(small, rows)
            after = _allocated(rows.device) if before is not None else None
            if not hasattr(small, "dequantize"):
                raise Refused(f"{type(small).__name__} has no dequantize() to check its reading against")
            with torch._C.DisableTorchFunctionSubclass():
                want = torch.Tensor.to(small.dequantize(), param.dtype)[:n]
            reason = self_check(reference, small, want)
            if reason:
                raise Refused(reason)
            self.trusted.add(key)
            transients = _DEFAULT_TRANSIENTS if known is None else known
            if before is not None and after is not None:
                transients = _TRANSIENTS[measured] = (after - before) / rows.numel()
            per_element = _MARGIN * (rows.element_size() + _REFERENCE + transients) + 0.25
            cap = max(BLOCK, int(budget / (per_element * BLOCK)) // BLOCK * BLOCK)
            if _agrees_with_fused(item, reference, small, n, round_to):
                # The kernel allocates nothing: its batches are bounded only so that a flagged
                # one is judged again by the type's write a budget-sized part at a time.
                self.fused.add(key)
                self.written[key] = cap
                cap = max(cap, _FUSED_BLOCKS)
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            self.refused[key] = str(exc) if isinstance(exc, Refused) else why_type(param, exc)
        self.capacity[key] = cap
        return cap


def _agrees_with_fused(
    item: Item, reference: Reference, small: Any, n: int, round_to: torch.dtype | None
) -> bool:
    """Whether the fused kernel writes the bytes the type's own write wrote: on the probe's
    ``n`` real blocks (``small`` holds them) and on crafted blocks where rules part."""
    if not fused.usable(item.reader, round_to, item.main):
        return False
    try:
        rounding = round_to is not None
        reader = reader_for(small)
        main = item.blocks.part(0, n).take(item.main, -item.start)
        if isinstance(reader, str) or differing_bytes(main, reader, rounding):
            return False
        crafted = crafted_rows(item.main.device)
        instance = reference._empty((crafted.shape[0], BLOCK), crafted.device)
        reference.write(instance, rounded(crafted, round_to))
        reader = reader_for(instance)
        return not isinstance(reader, str) and differing_bytes(crafted, reader, rounding) == 0
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
