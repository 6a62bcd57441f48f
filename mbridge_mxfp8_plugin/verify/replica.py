"""The replica check: do the data-parallel replicas hold the same bits?

Every param is folded into a 64-bit value from the raw bits of what the GEMMs read (the values
of a param that holds them; the codes and the valid scale bytes of one that holds codes, never
the padding of the scale tiles, which no kernel writes). Bits are summed in rows of 4096 elements
as int64, so a single differing element always changes its row's sum; rows follow the same
sample as the shard check. One all-reduce (MAX) per data-parallel group carries the folds, their
bitwise complements (MAX of ``~h`` is ``~MIN h``) and this rank's mismatch count, so every rank
learns which params differ and whether any peer's shard check failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .read import BLOCK, Reader
from .report import WeightReport
from .sampling import first_sampled

__all__ = ["fold_sources", "group_size", "reduce_folds", "row_sums"]

_FOLD_ROW = 1 << 12  # elements per row sum
_MAX_ROWS = 1 << 9  # rows summed per kernel: bounds the int64 copy the sum makes (16 MiB)
_HASH_MOD = 8191
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fold_sources(param: Any, reader: Reader | str) -> list[torch.Tensor]:
    """What is folded: the values, or the codes and the scale bytes of real blocks. A quantized
    param the shard check cannot read (``reader`` is why) is folded from the bytes it holds:
    per-tensor FP8's ``_data`` and its one scale, or an MXFP8 type's row-wise codes alone."""
    if isinstance(reader, str):
        found = (getattr(param, a, None) for a in ("_data", "_scale_inv", "_rowwise_data"))
        held = [t for t in found if isinstance(t, torch.Tensor) and t.is_contiguous()]
        if not held:
            raise TypeError(f"{type(param).__name__} holds no bytes the replica check can fold ({reader})")
        return held
    if reader.scales is None:
        return [reader.flat]
    last = param.shape[-1] if param.dim() else 1
    rows, per_row = param.numel() // max(last, 1), -(-last // BLOCK)
    scales = reader.scales.view(-1, reader.scale_cols)[:rows, :per_row]
    return [reader.flat, scales]


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``values``, flat, as the widest integer type the layout allows."""
    flat = values.detach().reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    if bits.element_size() < 4 and bits.numel() % (4 // bits.element_size()) == 0:
        try:
            return bits.view(torch.int32)
        except RuntimeError:  # storage offset not 4-byte aligned
            pass
    return bits


def _sums(rows: torch.Tensor) -> torch.Tensor:
    """Row sums as int64, a bounded number of rows at a time (the sum casts its input first)."""
    parts = [rows[i : i + _MAX_ROWS].sum(dim=1, dtype=torch.int64) for i in range(0, len(rows), _MAX_ROWS)]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def row_sums(tensors: Sequence[torch.Tensor], stride: int, offset: int) -> list[torch.Tensor]:
    """Sums of the bits of the sampled rows of ``tensors`` (int64, exact: any single differing
    element changes its row's sum). 2-D tensors (scale bytes) are summed per row of theirs. The
    same rows on every replica, as long as every rank passes the same offset."""
    out = []
    for t in tensors:
        if t.dim() == 2 and not t.is_contiguous():
            rows = t.view(torch.int8) if t.element_size() == 1 else t
            if len(rows):
                out.append(_sums(rows[first_sampled(offset, stride, len(rows)) :: stride]))
            continue
        bits = _bits(t)
        n = bits.numel()
        count = n // _FOLD_ROW
        if count:
            first = first_sampled(offset, stride, count)
            out.append(_sums(bits[: count * _FOLD_ROW].view(count, _FOLD_ROW)[first::stride]))
        if n > count * _FOLD_ROW and (stride == 1 or count == 0):
            out.append(bits[count * _FOLD_ROW :].sum(dtype=torch.int64).reshape(1))
    return out


def _folds(per_param: list[list[torch.Tensor]], device: Any) -> torch.Tensor:
    """One 64-bit fold per param of its row sums, weighted by position, in a handful of kernels
    for all params together. A single differing row changes its param's fold: the row-sum delta
    (< 2**37) times a weight (< 2**21) cannot wrap to 0 modulo 2**64."""
    counts = [sum(int(r.numel()) for r in rows) for rows in per_param]
    flat = [r.to(device) for rows in per_param for r in rows]
    out = torch.zeros(len(per_param), dtype=torch.int64, device=device)
    if not flat:
        return out
    sums = torch.cat(flat)
    ids = torch.repeat_interleave(
        torch.arange(len(counts), device=device), torch.tensor(counts, device=device)
    )
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64, device=device).cumsum(0)
    pos = torch.arange(sums.numel(), dtype=torch.int64, device=device) - starts[ids]
    weights = pos % _HASH_MOD + 1000004
    return out.index_add_(0, ids, sums * weights)


#: id(group) -> (group, its size): ``get_world_size`` costs about a millisecond per call.
_GROUP_SIZES: dict[int, tuple[Any, int]] = {}


def group_size(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    known = _GROUP_SIZES.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    size = int(dist.get_world_size(group))
    _GROUP_SIZES[id(group)] = (group, size)
    return size


def reduce_folds(
    hashes: dict[int, tuple[Any, list[list[torch.Tensor]], list[str]]],
    report: WeightReport,
    max_names: int,
    device: Any,
) -> None:
    """One MAX all-reduce per data-parallel group: folds, their complements, the mismatch count."""
    import torch.distributed as dist

    first = True
    for group, rows, param_names in hashes.values():
        h = _folds(rows, device if device is not None else torch.device("cpu"))
        local = torch.tensor(
            [report.shard_mismatch_count if first else 0], dtype=torch.int64, device=h.device
        )
        vec = torch.cat([h, torch.bitwise_not(h), local])
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        n = len(rows)
        vec = vec.cpu()
        differs = (vec[:n] != torch.bitwise_not(vec[n : 2 * n])).tolist()
        for name, bad in zip(param_names, differs, strict=True):
            if bad:
                report.replica_mismatch_count += 1
                if len(report.replica_mismatches) < max_names:
                    report.replica_mismatches.append(name)
        if first:
            report.peer_mismatch_count = int(vec[-1])
        report.groups_reduced += 1
        first = False
