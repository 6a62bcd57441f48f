"""Are the model's weights what the optimizer says they are? A read-only check, and a repair.

No framework checks that the MXFP8 params a model computes with come from the fp32 main params
the distributed optimizer holds. Megatron's ``check_param_hashes_across_dp_replicas`` compares
replicas only, so weights that are stale on every replica alike (defect B, or an export right
after an optimizer step) pass it. :func:`verify_weights` checks both:

* **shard check** (no collective): each rank takes the params it owns a shard of (its distributed
  optimizer's ``model_float16_groups`` with their ``shard_fp32_from_float16_groups`` main shards
  and param ranges) and compares, value by value, the param's dequantized slice with the main
  shard pushed through the same path a param sync takes: rounded to the param buffer's dtype
  (bf16 in reuse mode: the main shard is staged into the bf16 view and gathered), then quantized
  by the param's own quantization (TE: a row-wise copy of the param's ``_quantizer``; a param type
  with ``quantize_``/``dequantize`` that can be instantiated from a plain tensor, such as the
  test kit's emulation: a fresh instance of it; otherwise TE's rule in
  :mod:`~mbridge_mxfp8_plugin.mxfp8_cast`) and dequantized. bf16 params are compared with the
  main shard rounded to bf16. Elements of a 32-element MXFP8 block that straddles two ranks'
  shards are skipped (their scale depends on values this rank does not hold) and counted.
* **replica check** (one small all-reduce per data-parallel group): a 64-bit fold of every param's
  bits, all-reduced with MAX over the dense (or expert) data-parallel group alongside its bitwise
  complement (so MAX gives the minimum too) and this rank's mismatch count. Every rank learns
  which params disagree and whether any peer's shard check failed.

Cost: by default every 16th 32-element block of each owned slice is compared (``sample``, the
phase rotating per call; ``sample=1.0`` compares every block), in batches of at most 16 Mi
elements across params; TE params need one dequantized copy each; one host sync; nothing
persists. :func:`ensure_weights_current` makes the weights current on demand
(export, RL refit) through the shared :class:`~mbridge_mxfp8_plugin.sync.ParamSyncEngine`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .buckets import is_megatron_ddp, is_megatron_fsdp
from .errors import MXFP8PluginError, MXFP8UsageError
from .mxfp8_cast import MXFP8_BLOCK as _BLOCK
from .mxfp8_cast import mxfp8_quantize
from .options import DEFAULT_VERIFY_SAMPLE
from .plan import distributed_optimizers
from .sync import ParamSyncEngine, SyncStats

__all__ = ["ParamMismatch", "WeightReport", "ensure_weights_current", "find_model_chunks", "verify_weights"]

_FOLD_ROW = 1 << 12  # elements per row sum of the replica fold
_HASH_MOD = 8191
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class ParamMismatch:
    """One param whose shard differs from its quantized main shard (on the rank that reports it)."""

    name: str
    max_abs_diff: float
    elements: int  # how many compared elements differ

    def __str__(self) -> str:
        return f"{self.name} (max |diff| {self.max_abs_diff:.3g}, {self.elements} elements)"


@dataclass
class WeightReport:
    """What :func:`verify_weights` found on this rank (and, through the all-reduce, on its peers)."""

    event: str
    #: params whose owned shard was compared, and the elements compared / skipped
    params_checked: int = 0
    elements_checked: int = 0
    #: elements of MXFP8 blocks split between two ranks' shards (their scale is not local)
    elements_skipped: int = 0
    #: ``name: reason`` for owned params that could not be compared (e.g. per-tensor FP8)
    unchecked: list[str] = field(default_factory=list)
    #: this rank's shard mismatches, first ``max_names`` of them, and their total count
    shard_mismatches: list[ParamMismatch] = field(default_factory=list)
    shard_mismatch_count: int = 0
    #: the largest shard mismatch count of any rank in this rank's data-parallel group
    peer_mismatch_count: int = 0
    #: params whose bits differ between data-parallel replicas (first ``max_names``), and how many
    replica_mismatches: list[str] = field(default_factory=list)
    replica_mismatch_count: int = 0
    #: params hashed for the replica check; data-parallel groups reduced over (size > 1)
    params_hashed: int = 0
    groups_reduced: int = 0
    #: how the reference was quantized: "quantizer" / "own type" / "te-rule cast" -> params
    reference_paths: dict[str, int] = field(default_factory=dict)
    #: fraction of blocks compared (1.0: every block); see :func:`verify_weights`'s ``sample``
    sample: float = 1.0
    note: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.shard_mismatch_count or self.peer_mismatch_count or self.replica_mismatch_count)

    def message(self) -> str:
        """One line for a log: the event, the verdict and the first offending params."""
        head = f"MXFP8 weight check at {self.event}:"
        if self.ok:
            return (
                f"{head} OK ({self.params_checked} owned params, {self.elements_checked} elements"
                f"{'' if self.sample >= 1.0 else f' (sample {self.sample:.3g})'} equal "
                f"their quantized fp32 main params; {self.params_hashed} params agree across "
                f"{self.groups_reduced} data-parallel group(s))"
            )
        parts = []
        if self.shard_mismatch_count:
            first = ", ".join(str(m) for m in self.shard_mismatches)
            parts.append(
                f"{self.shard_mismatch_count} params differ from their quantized fp32 main params on "
                f"this rank (first: {first})"
            )
        elif self.peer_mismatch_count:
            parts.append(f"a data-parallel peer found {self.peer_mismatch_count} params that differ")
        if self.replica_mismatch_count:
            parts.append(
                f"{self.replica_mismatch_count} params differ between data-parallel replicas "
                f"(first: {', '.join(self.replica_mismatches)})"
            )
        return f"{head} WRONG: " + "; ".join(parts)

    def raise_if_bad(self) -> None:
        """Raise :class:`MXFP8PluginError` with :meth:`message` when the check failed."""
        if not self.ok:
            raise MXFP8PluginError(
                self.message() + ". The model computes with weights that are not the optimizer's; "
                "see docs/verify.md"
            )


# ---------------------------------------------------------------------------- discovery
_MAX_DEPTH = 6


def find_model_chunks(roots: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """Megatron-core DDP chunks reachable from ``roots``; returns ``(ddp_chunks, fsdp_chunks)``.

    Walks lists and ``ModuleList``-like containers (NeMo's ``MegatronParallel`` is one), ``.module``
    wrapper chains (``Float16Module`` -> DDP) and child modules, but never into a DDP chunk: the
    model inside can be huge and holds nothing we need. Order is preserved, duplicates dropped.
    Shared by the weight verifier (which accepts whatever wrapper the caller holds) and, through
    ``_adapter``, the Lightning adapter (which finds the chunks behind a trainer); here because
    the verifier sits below the adapters.
    """
    found: list[Any] = []
    fsdp: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(obj))
        if is_megatron_fsdp(obj):
            fsdp.append(obj)
            return
        if is_megatron_ddp(obj):
            found.append(obj)
            return
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
            return
        inner = getattr(obj, "module", None) if not isinstance(obj, type) else None
        if inner is not None:
            visit(inner, depth + 1)
        children = getattr(obj, "children", None)
        if callable(children):
            try:
                kids = list(children())
            except TypeError:
                kids = []
            for child in kids:
                visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return found, fsdp


def _chunks(model_chunks: Sequence[Any] | Any) -> list[Any]:
    """The megatron-core DDP chunks behind whatever the caller holds (a list, NeMo's wrappers)."""
    found, _ = find_model_chunks([model_chunks])
    if not found:
        raise MXFP8UsageError(
            "verify_weights / ensure_weights_current need megatron-core DistributedDataParallel model "
            f"chunks; found none in {type(model_chunks).__name__}"
        )
    return found


@dataclass
class _Owned:
    main: torch.Tensor | None
    start: int  # the shard's range inside the flattened param
    end: int
    buffer_dtype: torch.dtype | None  # dtype of the bucket's param_data (what the gather moves)


def _owned_shards(optimizer: Any) -> tuple[dict[Any, _Owned], str]:
    """param -> its main shard and range, for every param this rank's optimizers own a shard of."""
    owned: dict[Any, _Owned] = {}
    try:
        for opt in distributed_optimizers(optimizer):
            for mains, params in zip(
                opt.shard_fp32_from_float16_groups, opt.model_float16_groups, strict=True
            ):
                for main, param in zip(mains, params, strict=True):
                    rng = opt._get_model_param_range_map(param)["param"]
                    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[param]
                    data = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                    owned[param] = _Owned(main, rng.start, rng.end, None if data is None else data.dtype)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        return owned, f"optimizer layout not readable ({type(exc).__name__}: {exc}); shard check partial"
    return owned, ""


def _buffer_params(chunks: list[Any]) -> Iterator[tuple[int, bool, Any, Any]]:
    """(chunk index, expert, the chunk's DP group for that buffer, param) in buffer order."""
    for c, chunk in enumerate(chunks):
        for expert, buffers in (
            (False, chunk.buffers),
            (True, getattr(chunk, "expert_parallel_buffers", [])),
        ):
            wanted = "expt_dp_group" if expert else "dp_cp_group"
            for buffer in buffers:
                group = getattr(chunk, wanted, None) or getattr(buffer, "data_parallel_group", None)
                for bucket in buffer.buckets:
                    for param in bucket.params_list:
                        yield c, expert, group, param


# ---------------------------------------------------------------------------- numerics
def _holds_values(param: Any) -> bool:
    """Whether an FP8 param's storage holds its values (the kit's emulation), not bytes and
    scales (Transformer Engine's wrappers)."""
    return not (
        hasattr(param, "_rowwise_data") or hasattr(param, "_data") or not hasattr(type(param), "quantize_")
    )


def _plain() -> Any:
    return torch._C.DisableTorchFunctionSubclass()


def _values(param: Any, fp8: bool) -> torch.Tensor:
    """The values the model computes with, flat, in the param's high-precision dtype (no grad).

    An alias of the param's storage wherever it holds the values (plain params, the test kit's
    emulation, whose non-structural ops return plain tensors); Transformer Engine's wrapper
    tensors hold bytes and scales, so they are dequantized (one bf16 copy of the param).
    """
    with torch.no_grad():
        if fp8 and not _holds_values(param):
            return param.dequantize().reshape(-1)
        # A plain tensor over the param's storage: the views below skip the subclass's
        # ``__torch_function__`` (host time per param is most of a sampled check's cost).
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.reshape(param.detach(), -1)


def _quantize_like(param: Any, values: torch.Tensor, report: WeightReport, params: int = 1) -> torch.Tensor:
    """``values`` (2-D rows of the param) quantized and dequantized as ``param`` would be, in the
    param's dtype (exact: every MXFP8 value of a scale >= 2**-124 is a bf16 value)."""
    quantizer = getattr(param, "_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "quantize"):
        try:
            # Transformer Engine: the param's own quantizer, row-wise only (the copy leaves the
            # param's usage flags alone); TE wants whole 32-row tiles, so pad with zero rows.
            q = quantizer.copy() if hasattr(quantizer, "copy") else quantizer
            if hasattr(q, "set_usage"):
                q.set_usage(rowwise=True, columnwise=False)
            rows = values.shape[0]
            padded = (
                values if rows % _BLOCK == 0 else torch.nn.functional.pad(values, (0, 0, 0, (-rows) % _BLOCK))
            )
            out = q.quantize(padded).dequantize(dtype=param.dtype)[:rows]
            report.reference_paths["quantizer"] = report.reference_paths.get("quantizer", 0) + params
            return out
        except Exception:  # noqa: BLE001 - fall back to the next path; recorded in reference_paths
            pass
    cls = type(param)
    if hasattr(cls, "quantize_") and hasattr(cls, "dequantize"):
        try:
            fresh = torch.empty(values.shape, dtype=param.dtype, device=values.device).as_subclass(cls)
            fresh.quantize_(values)
            out = fresh.dequantize().to(param.dtype)
            report.reference_paths["own type"] = report.reference_paths.get("own type", 0) + params
            return out
        except Exception:  # noqa: BLE001 - wrapper subclasses (TE) cannot be made this way
            pass
    report.reference_paths["te-rule cast"] = report.reference_paths.get("te-rule cast", 0) + params
    return mxfp8_quantize(values).to(param.dtype)


@dataclass
class _Diff:
    """Differences found in one param's owned slice, over the blocks compared."""

    elements: int = 0
    worst: float = 0.0

    def add(self, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
        if got.numel() == 0 or torch.equal(got, want):
            return
        diff = (got.float() - want.float()).abs()
        bad = ~(diff <= atol)  # NaN counts as a difference
        count = int(bad.sum())
        if count:
            self.elements += count
            self.worst = max(self.worst, float(diff.nan_to_num(nan=float("inf")).max()))


def _stride(sample: float) -> int:
    if not 0.0 < sample <= 1.0:
        raise MXFP8UsageError(f"verify sample must be in (0, 1], got {sample!r}")
    return max(1, round(1.0 / sample))


def _first(offset: int, stride: int, blocks: int) -> int:
    """The first sampled block of ``blocks``: rotates with ``offset`` over ``min(stride, blocks)``
    phases, so every block is visited within ``stride`` calls and every param yields one."""
    return offset % max(1, min(stride, blocks))


@dataclass
class _Batch:
    """Sampled blocks of params that share one reference path, compared in one go.

    Per-param work is a few strided views; the copies, the quantization and the comparison run
    once per batch of at most ``_CHUNK`` elements, so the host cost does not grow with the
    number of ops per param and the temporaries stay bounded whatever the param sizes.
    """

    param: Any  # representative: its quantization is the batch's
    mxfp8: bool
    round_to: torch.dtype | None
    got: list[torch.Tensor] = field(default_factory=list)
    main: list[torch.Tensor] = field(default_factory=list)
    owners: list[tuple[int, int]] = field(default_factory=list)  # (slot, blocks)
    params: set[int] = field(default_factory=set)
    blocks: int = 0


_CHUNK = 1 << 24  # elements compared per batch: bounds the check's temporaries (~0.5 GB)


class _ShardCheck:
    """The shard check of one :func:`verify_weights` call: sampled blocks of every owned slice."""

    def __init__(self, report: WeightReport, atol: float, stride: int, offset: int) -> None:
        self.report, self.atol, self.stride, self.offset = report, atol, stride, offset
        self.batches: dict[tuple[Any, ...], _Batch] = {}
        self.slots: list[tuple[str, _Diff]] = []
        self.verdicts: list[tuple[_Batch, torch.Tensor]] = []

    def add(self, name: str, param: Any, values: torch.Tensor, own: _Owned, fp8: bool, mxfp8: bool) -> None:
        report = self.report
        if own.main is None:
            report.unchecked.append(f"{name}: main params live inside the optimizer (precision-aware)")
            return
        if fp8 and not mxfp8:
            report.unchecked.append(f"{name}: per-tensor FP8 scale spans every rank's shard")
            return
        main = own.main  # the caller holds no_grad: views of it need no detach
        if main.dim() != 1 or not main.is_contiguous():
            main = main.reshape(-1)
        s, e = own.start, own.end
        buf = own.buffer_dtype
        # In reuse mode the main shard travels as bf16 (staged into the bf16 view of the grad
        # buffer); with a uint8 FP8 buffer it is cast from fp32 directly.
        round_to = buf if buf is not None and buf.is_floating_point and buf.itemsize >= 2 else None
        quantizer = getattr(param, "_quantizer", None)
        key = (mxfp8, type(param), param.dtype, round_to, type(quantizer), getattr(quantizer, "dtype", None))
        slot = len(self.slots)
        self.slots.append((name, _Diff()))
        report.params_checked += 1
        if mxfp8:
            pieces, checked, whole = self._mxfp8_blocks(param, values, main, s, e)
            report.elements_skipped += (e - s) - whole
        else:
            pieces, checked = self._plain_blocks(values, main, s, e)
        report.elements_checked += checked
        batch = self.batches.get(key)
        if batch is None:
            batch = self.batches[key] = _Batch(param, mxfp8, round_to)
        for got, want in pieces:
            batch.got.append(got)
            batch.main.append(want)
            batch.owners.append((slot, got.shape[0]))
            batch.params.add(slot)
            batch.blocks += got.shape[0]
            if batch.blocks * _BLOCK >= _CHUNK:
                self._flush(key)
                batch = self.batches[key] = _Batch(param, mxfp8, round_to)

    def _strided(
        self, values: torch.Tensor, main: torch.Tensor, at: int, main_at: int, blocks: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``stride``-th of ``blocks`` 32-element blocks from flat element ``at`` of
        ``values`` (``main_at`` of ``main``), as ``(k, 32)`` views in pieces of at most
        ``_CHUNK`` elements: one ``as_strided`` per side and piece, no copy."""
        k = max(0, -(-blocks // self.stride))
        step = self.stride * _BLOCK
        per = _CHUNK // _BLOCK
        v0, m0 = values.storage_offset() + at, main.storage_offset() + main_at
        return [
            (
                values.as_strided((min(per, k - lo), _BLOCK), (step, 1), v0 + lo * step),
                main.as_strided((min(per, k - lo), _BLOCK), (step, 1), m0 + lo * step),
            )
            for lo in range(0, k, per)
        ]

    def _plain_blocks(
        self, values: torch.Tensor, main: torch.Tensor, s: int, e: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """Blocks of 32 counted from the shard start (no scale: any grouping compares the same)."""
        n = (e - s) // _BLOCK
        first = _first(self.offset, self.stride, n)
        pieces = self._strided(values, main, s + first * _BLOCK, first * _BLOCK, n - first)
        checked = sum(g.shape[0] for g, _ in pieces) * _BLOCK
        tail = (e - s) - n * _BLOCK
        if tail and (self.stride == 1 or n == 0):
            pad = (0, _BLOCK - tail)
            got = torch.nn.functional.pad(values[s + n * _BLOCK : e], pad).view(1, _BLOCK)
            pieces.append((got, torch.nn.functional.pad(main[n * _BLOCK : e - s], pad).view(1, _BLOCK)))
            checked += tail
        return pieces, checked

    def _mxfp8_blocks(
        self, param: Any, values: torch.Tensor, main: torch.Tensor, s: int, e: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
        """The sampled MXFP8 blocks (32 elements of a row; a row's last may be shorter) that lie
        wholly inside the shard ``[s, e)``, as ``(k, 32)`` rows, zero-padded (zeros leave a
        block's scale unchanged). Blocks straddling a shard boundary have a scale this rank cannot
        compute, so they are skipped. Returns (got, main) pieces, elements compared, elements in
        whole blocks."""
        last = param.shape[-1] if param.dim() > 0 else 1
        per_row = -(-last // _BLOCK)
        # Whole blocks inside [s, e) form one range of global block ids (row * per_row + j).
        r, c = divmod(s, last)
        j = -(-c // _BLOCK)
        g0 = r * per_row + j if j < per_row else (r + 1) * per_row
        r, c = divmod(e, last)
        g1 = max(g0, r * per_row + c // _BLOCK)
        n = g1 - g0
        first = _first(self.offset, self.stride, n)
        if last % _BLOCK == 0:  # blocks are the flat 32-element runs: strided views, no index
            at = (g0 + first) * _BLOCK
            pieces = self._strided(values, main, at, at - s, n - first)
            return pieces, sum(g.shape[0] for g, _ in pieces) * _BLOCK, n * _BLOCK
        ids = torch.arange(g0 + first, g1, self.stride, device=values.device)
        rows, cols = ids // per_row, ids % per_row
        starts = rows * last + cols * _BLOCK
        lanes = torch.arange(_BLOCK, device=values.device)
        inside = lanes < (last - cols * _BLOCK).clamp(max=_BLOCK).unsqueeze(1)
        index = torch.where(inside, starts.unsqueeze(1) + lanes, s)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        got = torch.where(inside, values[index], zero)
        want = torch.where(inside, main.to(values.device)[index - s], torch.zeros((), dtype=main.dtype))
        # Elements in whole blocks: each row's last block holds only ``last % 32``.
        short_blocks = g1 // per_row - g0 // per_row
        whole = n * _BLOCK - short_blocks * (_BLOCK - last % _BLOCK)
        return [(got, want)], int(inside.sum()), whole

    def _compare(self, batch: _Batch, report: WeightReport) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's got and reference blocks, each gathered into one ``(blocks, 32)`` tensor."""
        # One cat per side (a launch each, whatever the number of pieces); then the rounding.
        got = torch.cat(batch.got) if len(batch.got) > 1 else batch.got[0]
        main = torch.cat(batch.main) if len(batch.main) > 1 else batch.main[0]
        if batch.round_to is not None:
            main = main.to(batch.round_to)
        param = batch.param
        if batch.mxfp8:
            want = _quantize_like(param, main, report, len(batch.params))
        else:
            want = main.to(param.dtype)
        return got, want.to(got.device)

    def _flush(self, key: tuple[Any, ...]) -> None:
        """Compare one batch; the verdict stays on the device (no host sync per batch)."""
        batch = self.batches.pop(key, None)
        if batch is None or not batch.got:
            return
        try:
            got, want = self._compare(batch, self.report)
            if self.atol:
                differs = ~((got.float() - want.float()).abs() <= self.atol).all()
            else:
                differs = (got != want).any()  # NaN counts as a difference
            self.verdicts.append((batch, differs))
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            for slot in sorted(batch.params):
                self.report.unchecked.append(f"{self.slots[slot][0]}: {type(exc).__name__}: {exc}")

    def finish(self, max_names: int) -> None:
        """Flush what is left, read every batch's verdict in one transfer, and attribute the
        differences of a failed batch to its params (recomputed: the failure path only)."""
        for key in list(self.batches):
            self._flush(key)
        if self.verdicts:
            failed = torch.stack([d for _, d in self.verdicts])
            for (batch, _), bad in zip(self.verdicts, failed.tolist(), strict=True):
                if not bad:
                    continue
                got, want = self._compare(batch, WeightReport(event=""))
                row = 0
                for slot, blocks in batch.owners:
                    self.slots[slot][1].add(got[row : row + blocks], want[row : row + blocks], self.atol)
                    row += blocks
        for name, found in self.slots:
            if found.elements:
                self.report.shard_mismatch_count += 1
                if len(self.report.shard_mismatches) < max_names:
                    self.report.shard_mismatches.append(ParamMismatch(name, found.worst, found.elements))


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


def _row_sums(tensors: Sequence[torch.Tensor], stride: int, offset: int) -> list[torch.Tensor]:
    """Sums of the bits of the sampled ``_FOLD_ROW``-element rows of ``tensors`` (int64, exact:
    any single differing element changes its row's sum). The same rows on every replica, as
    long as every rank passes the same offset (every rank makes the same calls)."""
    out = []
    for t in tensors:
        bits = _bits(t)
        n = bits.numel()
        rows = n // _FOLD_ROW
        if rows:
            first = _first(offset, stride, rows)
            view = bits[: rows * _FOLD_ROW].view(rows, _FOLD_ROW)[first::stride]
            out.append(view.sum(dim=1, dtype=torch.int64))
        if n > rows * _FOLD_ROW and (stride == 1 or rows == 0):
            out.append(bits[rows * _FOLD_ROW :].sum(dtype=torch.int64).reshape(1))
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


def _replica_bits(param: Any, values: torch.Tensor) -> list[torch.Tensor]:
    """What the replica check hashes: TE's stored bytes and scales where the param has them
    (cheaper than its dequantized values and exactly what the GEMMs read), else the values."""
    data = getattr(param, "_rowwise_data", None)
    scales = getattr(param, "_rowwise_scale_inv", None)
    if isinstance(data, torch.Tensor) and isinstance(scales, torch.Tensor):
        return [data, scales]
    return [values]


# ---------------------------------------------------------------------------- the check
def verify_weights(
    model_chunks: Sequence[Any] | Any,
    optimizer: Any,
    *,
    event: str,
    atol: float = 0.0,
    max_names: int = 5,
    sample: float = DEFAULT_VERIFY_SAMPLE,
    offset: int | None = None,
) -> WeightReport:
    """Check that the params equal their quantized fp32 main params, and that replicas agree.

    Call it on every rank of the job at the same point (it issues one all-reduce per
    data-parallel group), where the weights are meant to be current: after a forced param sync
    and whatever the loop or the plugin does after it, after a checkpoint load, at the end of
    training. Between an optimizer step and the next forward they are not (the gather comes
    with that forward; :func:`ensure_weights_current` brings it forward). Reads only: it works
    whether or not the plugin is active. ``atol`` 0 means exact: both sides take the same
    rounding path. ``event`` names the moment in the report and the error.

    ``sample`` is the fraction of 32-element blocks compared (and of 4096-element rows folded
    for the replica check): every ``round(1/sample)``-th block of each owned slice, at least
    one per param. The defects this guards against (a shifted slice, stale weights, gradients
    read as weights, drifted replicas) change nearly every block, so a sample finds them at a
    fraction of the cost; a corruption of a few blocks is found within ``round(1/sample)``
    calls, because the sampled phase rotates with ``offset`` (default: this process's call
    count, the same on every rank as long as every rank makes the same calls). ``sample=1.0``
    compares every block.
    """
    t0 = time.perf_counter()
    stride = _stride(sample)
    if offset is None:
        offset = next(_CALLS)
    report = WeightReport(event=event, sample=1.0 / stride)
    chunks = _chunks(model_chunks)
    owned, report.note = _owned_shards(optimizer)
    names = {
        p: (f"{c}." if len(chunks) > 1 else "") + n
        for c, ch in enumerate(chunks)
        for n, p in ch.named_parameters()
    }
    if any(g.param_gather_handle is not None for ch in chunks for g in _groups(ch)):
        report.note = (report.note + "; " if report.note else "") + (
            "a param all-gather is in flight: this describes the weights before it lands"
        )
    from megatron.core import fp8_utils

    check = _ShardCheck(report, atol, stride, offset)
    sizes: dict[int, int] = {}
    hashes: dict[int, tuple[Any, list[list[torch.Tensor]], list[str]]] = {}
    device: Any = None
    with torch.no_grad():  # views of params and main shards, no autograd bookkeeping
        for _, _, group, param in _buffer_params(chunks):
            name = names.get(param) or f"<param {tuple(param.shape)}>"
            if id(group) not in sizes:
                sizes[id(group)] = _group_size(group)
            replicated = sizes[id(group)] > 1
            rows: list[torch.Tensor] = []
            try:
                if param not in owned and not replicated:
                    continue
                fp8 = fp8_utils.is_float8tensor(param)
                mxfp8 = fp8_utils.is_mxfp8tensor(param)
                # Params that hold their values (plain, the kit's emulation) are read with their
                # subclass's __torch_function__ off: its Python cost per attribute and view is
                # most of a sampled check's time. TE's wrappers keep theirs.
                with contextlib.nullcontext() if fp8 and not _holds_values(param) else _plain():
                    values = _values(param, fp8)
                    device = values.device
                    if param in owned:
                        check.add(name, param, values, owned[param], fp8, mxfp8)
                    if replicated:  # a group of one has no replica to disagree with: no fold
                        rows = _row_sums(_replica_bits(param, values), stride, offset)
            except Exception as exc:  # noqa: BLE001 - a rank must still join the all-reduce below
                report.unchecked.append(f"{name}: {type(exc).__name__}: {exc}")
            if replicated:
                entry = hashes.setdefault(id(group), (group, [], []))
                entry[1].append(rows)
                entry[2].append(name)
    check.finish(max_names)
    report.params_hashed = sum(len(v[1]) for v in hashes.values())
    _reduce(hashes, report, max_names, device)
    report.seconds = time.perf_counter() - t0
    return report


#: Calls so far in this process: the default rotation of the sampled blocks.
_CALLS = itertools.count()


#: id(group) -> (group, its size): ``get_world_size`` costs about a millisecond per call.
_GROUP_SIZES: dict[int, tuple[Any, int]] = {}


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    known = _GROUP_SIZES.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    size = int(dist.get_world_size(group))
    _GROUP_SIZES[id(group)] = (group, size)
    return size


def _groups(chunk: Any) -> list[Any]:
    return list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", []))


def _reduce(
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
        # MAX of ~h is ~MIN of h: one reduction yields both ends of every fold's range.
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


# ---------------------------------------------------------------------------- the repair
#: first model chunk -> (ids of all chunks, version counters of their buffers and main shards)
#: when ensure_weights_current last made the weights current. Keyed by the chunk, not the
#: engine: without an adapter nothing else keeps the shared engine alive between calls.
_CURRENT_AT: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _versions(engine: ParamSyncEngine, optimizer: Any) -> tuple[int, ...]:
    """Version counters of every param/grad buffer and every fp32 main shard.

    Every training step bumps the buffers' counter (``zero_grad_buffer`` is an in-place op on
    them, and views share their base's counter); an optimizer step or checkpoint load through
    torch ops bumps the main shards'. Fused optimizers that write through raw pointers (apex/TE
    ``multi_tensor_applier``) do not, but their steps follow a ``zero_grad_buffer``. Reading the
    counters costs no kernel and no sync.
    """
    out: list[int] = []
    for chunk in engine.model_chunks:
        for buffer in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for data in (buffer.param_data, buffer.grad_data):
                out.append(-1 if data is None else data._version)
    for opt in distributed_optimizers(optimizer):
        out.extend(m._version for group in opt.shard_fp32_from_float16_groups for m in group if m is not None)
    return tuple(out)


def ensure_weights_current(model_chunks: Sequence[Any] | Any, optimizer: Any) -> SyncStats:
    """Make the params equal the quantized fp32 main params now; do nothing where they already do.

    For readers of a live model between training steps (export, RL refit, a custom eval): after
    an optimizer step, with reuse, the params hold the previous step's weights until the next
    forward gathers. Call on every rank at the same point (it may issue the param all-gathers).
    Uses the model's shared :class:`~mbridge_mxfp8_plugin.sync.ParamSyncEngine`, so it
    cooperates with the plugin's callbacks and API.

    Nothing is done (no collective, no write) when:

    * the job is not in the affected mode (no MXFP8 reuse, or no ``overlap_param_gather``: the
      optimizer step then gathers synchronously);
    * this function made them current last and no param/grad buffer or main shard has changed
      since (their version counters: every training step zeroes the buffers in place), or the
      plugin's engine refreshed them and no step has started since (its adapters clear the
      engine's flag in ``step_started``);
    * the loop's last forced sync gathered freshly staged main params and core wrote them back
      (Megatron-Bridge >= 0.6 on megatron-core >= 0.19, judged by behaviour: core offers
      ``prepare_model_params_for_param_sync``, writes forced gathers back and resets the
      dispatch state, the live loop calls it, and every bucket group looks just synced).

    Otherwise it stages the main shards, forces one all-gather per bucket group and, on core
    < 0.18 (no write-back), copies the result into the params at the padded offsets and
    re-zeroes the shared buffer. Like the engine's refresh it leaves the bucket groups marked
    synced, so pre-hooks that stay on do not gather over the weights; on core < 0.19 the next
    training step must begin with the plugin's ``step_started`` (its callbacks and
    :func:`~mbridge_mxfp8_plugin.mxfp8_param_sync` do that) or it would skip its gather (C).
    """
    chunks = _chunks(model_chunks)
    engine = ParamSyncEngine.shared(chunks, optimizer)
    if not engine.active:
        return SyncStats(note="inactive: not MXFP8 params reusing the grad buffer")
    if not engine.overlap:
        return SyncStats(note="no overlap_param_gather: the optimizer step gathered already")
    if engine.alignment is None:
        engine.prepare()
    key = ParamSyncEngine.model_key(chunks)
    recorded = _CURRENT_AT.get(chunks[0])
    mine = recorded is not None and recorded[0] == key
    if mine and recorded is not None and recorded[1] == _versions(engine, optimizer):
        return SyncStats(note="weights already current (nothing changed since the last call)")
    if engine.weights_fresh and not mine:
        # An adapter refreshed; its step_started clears the flag at the next step.
        return SyncStats(note="weights already current (refreshed by the plugin)")
    # The engine's flag is only as good as its step_started calls; the counters say a step ran.
    engine.weights_fresh = False
    engine.loop_stages_itself()
    stats = engine.refresh_weights(gathered_fresh=None)
    _CURRENT_AT[chunks[0]] = (key, _versions(engine, optimizer))
    return stats
