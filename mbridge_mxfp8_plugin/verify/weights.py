"""``verify_weights``: one call, on every rank at the same point; reads, never writes."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..mcore.chunks import model_chunks as _model_chunks
from ..mcore.layout import (
    LAYOUT_ERRORS,
    bucket_params,
    buffers,
    chunk_bucket_groups,
    distributed_optimizers,
    main_params,
    main_shards,
)
from ..options import DEFAULT_VERIFY_SAMPLE
from .batches import Owned
from .probe import Probed
from .read import Reader, reader_for
from .replica import fold_sources, group_size, reduce_folds, row_sums
from .report import WeightReport
from .sampling import stride_of
from .shard import ShardCheck

__all__ = ["verify_weights"]

#: The check's extra memory, sampled or full (issue 32: at most 64 MiB): it sizes the batches,
#: so nothing grows with the model; a full check of a larger model runs more batches.
_BUDGET_BYTES = 64 << 20

#: Calls so far in this process: the default rotation of the sampled blocks.
_CALLS = itertools.count()

#: Plans kept per optimizer (one per model chunks, sample, tolerance and budget: every sampled
#: phase shares its plan, the phase being data).
_MAX_PLANS = 64


@dataclass
class _Plan:
    """What a call worked out from the layout alone, kept for the next calls over the same
    tensors, whatever their sampled phase: the shard check's batches, the walk's verdicts of
    ``unchecked``, and the replicated params to fold (their folds read the current bits, so they
    are taken per call)."""

    check: ShardCheck
    note: str
    unchecked: list[str]
    replicated: list[tuple[Any, str, list[torch.Tensor] | None]] = field(default_factory=list)
    #: the walk's unchecked MXFP8 weights: how many, and their types
    unchecked_mxfp8: tuple[int, list[str]] = (0, [])
    device: Any = None


@dataclass
class _Layout:
    """What every plan of one layout shares: the walk's per-param facts (names, owned shards,
    readers) and the probes of each batch key. Another plan (another sample or tolerance) then
    costs only its block arithmetic and batching."""

    fingerprint: tuple[Any, ...]
    plans: dict[tuple[Any, ...], _Plan] = field(default_factory=dict)
    owned: tuple[dict[Any, Owned], str] | None = None
    names: dict[Any, str] | None = None
    readers: dict[int, Reader | str] = field(default_factory=dict)
    probed: dict[int, Probed] = field(default_factory=dict)  # by budget: it sets the capacities
    #: the tensors the plans read by address, held, and those addresses: the guard of a replay
    #: launched before the fingerprint is taken (``_replay_early``)
    addressed: list[torch.Tensor] = field(default_factory=list)
    pointers: list[int] = field(default_factory=list)


#: optimizer -> its layout. A changed fingerprint drops the layout and its plans: a stale plan's
#: views would keep moved-away storage alive.
_PLANS: weakref.WeakKeyDictionary[Any, _Layout] = weakref.WeakKeyDictionary()


def _owned_shards(optimizer: Any) -> tuple[dict[Any, Owned], str]:
    """param -> its main shard and range, for every param this rank's optimizers own a shard of."""
    owned: dict[Any, Owned] = {}
    try:
        for opt in distributed_optimizers(optimizer):
            for s in main_shards(opt):
                data = s.bucket_data
                owned[s.param] = Owned(
                    s.main, s.param_start, s.param_end, None if data is None else data.dtype
                )
    except LAYOUT_ERRORS as exc:
        return owned, f"optimizer layout not readable ({type(exc).__name__}: {exc}); shard check partial"
    return owned, ""


def _buffer_params(chunks: list[Any]) -> Iterator[tuple[Any, Any]]:
    """(the chunk's data-parallel group for the param's buffer, param) in buffer order."""
    for ref in buffers(chunks):
        group = ref.data_parallel_group
        for bucket in ref.bucket_list:
            for param in bucket_params(bucket):
                yield group, param


def _params_of(chunks: list[Any]) -> list[Any]:
    """Every buffer param in buffer order, as a list (the fingerprint reads it at every check)."""
    return [p for ref in buffers(chunks) for bucket in ref.bucket_list for p in bucket_params(bucket)]


def _unchecked_reason(param: Any, own: Owned, fp8: bool, mxfp8: bool) -> str:
    if own.main is None:
        return "main params live inside the optimizer (precision-aware)"
    if fp8 and not mxfp8:
        # Per-tensor FP8 (its scale spans every rank's shard), or another blockwise format.
        return f"{type(param).__name__} is quantized but not MXFP8: no 32-element block owns its scale"
    return ""


def verify_weights(
    model_chunks: Sequence[Any] | Any,
    optimizer: Any,
    *,
    event: str,
    atol: float = 0.0,
    max_names: int = 5,
    sample: float = DEFAULT_VERIFY_SAMPLE,
    offset: int | None = None,
    accept_unchecked: bool = False,
) -> WeightReport:
    """Check that the params equal their quantized fp32 main params, and that replicas agree.

    Call it on every rank of the job at the same point (it issues one all-reduce per
    data-parallel group), where the weights are meant to be current: after a forced param sync
    and whatever the loop or the plugin does after it, after a checkpoint load, at the end of
    training. Between an optimizer step and the next forward they are not (the gather comes
    with that forward; :func:`~mbridge_mxfp8_plugin.ensure_weights_current` brings it forward).
    Reads only: it works whether or not the plugin is active. ``atol`` 0 means exact: both sides
    take the same rounding path. ``event`` names the moment in the report and the error.

    ``sample`` is the fraction of 32-element blocks compared (and of 4096-element rows folded
    for the replica check): every ``round(1/sample)``-th block of each owned slice, at least
    one per param. The defects this guards against (a shifted slice, stale weights, gradients
    read as weights, drifted replicas) change nearly every block, so a sample finds them at a
    fraction of the cost; a corruption of a few blocks is found within ``round(1/sample)``
    calls, because the sampled phase rotates with ``offset`` (default: this process's call
    count, the same on every rank as long as every rank makes the same calls). ``sample=1.0``
    compares every block.

    An MXFP8 weight whose type the check cannot read makes the verdict ``not checked``, which is
    not ``ok`` (nor ``raise_if_bad``'s pass) unless ``accept_unchecked``: the weights the defects
    corrupt are the ones it could not vouch for.
    """
    t0 = time.perf_counter()
    stride = stride_of(sample)
    if offset is None:
        offset = next(_CALLS)
    report = WeightReport(event=event, sample=1.0 / stride, accept_unchecked=accept_unchecked)
    chunks = _model_chunks(model_chunks)
    from megatron.core import fp8_utils

    # What else a plan depends on: the budget, the quantized types core recognises. Not the
    # sampled phase: that is data the plan is run with (``ShardCheck.restart``).
    registered = tuple(getattr(fp8_utils, a, None) for a in _REGISTRY_ATTRS)
    budget = _BUDGET_BYTES
    key = (tuple(id(c) for c in chunks), stride, atol, budget, registered)
    layout, plan = _kept_plan(chunks, optimizer, key, report, offset)
    plans = layout.plans if layout is not None else None
    if plan is not None:
        report.unchecked.extend(plan.unchecked)
        report.mxfp8_unchecked, report.unchecked_types = (
            plan.unchecked_mxfp8[0],
            list(plan.unchecked_mxfp8[1]),
        )
        report.note = plan.note
    else:
        plan = _make_plan(chunks, optimizer, report, atol, stride, offset, layout or _Layout(()))
    if any(g.param_gather_handle is not None for ch in chunks for g in chunk_bucket_groups(ch)):
        report.note = (report.note + "; " if report.note else "") + (
            "a param all-gather is in flight: this describes the weights before it lands"
        )
    hashes: dict[int, tuple[Any, list[list[torch.Tensor]], list[str]]] = {}
    for group, name, source in plan.replicated:
        entry = hashes.setdefault(id(group), (group, [], []))
        with torch.no_grad():
            entry[1].append(row_sums(source, stride, offset) if source is not None else [])
        entry[2].append(name)
    plan.check.finish(max_names)
    if plans is not None and plan.check.reusable:
        if len(plans) >= _MAX_PLANS and key not in plans:
            plans.clear()
        plans[key] = plan
    report.params_hashed = sum(len(v[1]) for v in hashes.values())
    reduce_folds(hashes, report, max_names, plan.device)
    report.seconds = time.perf_counter() - t0
    return report


def _kept_plan(
    chunks: list[Any], optimizer: Any, key: tuple[Any, ...], report: WeightReport, offset: int
) -> tuple[_Layout | None, _Plan | None]:
    """This layout's kept state, and its plan of ``key`` ready for this call (None: none kept).
    A kept graph is launched before the fingerprint is taken (``_replay_early``) and is read only
    if the fingerprint then finds the layout unchanged."""
    early = _replay_early(optimizer, key, report, offset)
    addressed: list[torch.Tensor] = []
    fingerprint = _fingerprint(chunks, optimizer, addressed)
    layout = _layout_of(optimizer, fingerprint, addressed)
    plan = layout.plans.get(key) if layout is not None else None
    if early is not None and early is not plan:  # the layout changed: that replay is not read
        early.check.abandon()
    if plan is not None and plan is not early:
        plan.check.restart(report, offset)
    return layout, plan


def _replay_early(optimizer: Any, key: tuple[Any, ...], report: WeightReport, offset: int) -> _Plan | None:
    """The kept plan of ``key``, its graph launched at this call's phase before the layout is
    fingerprinted, so that the GPU compares while the host takes the fingerprint (most of a
    replayed check's host time); None where there is no graph to launch.

    Launching before knowing the layout is unchanged is safe because the plan holds every tensor
    its graph reads (its views, the layout's ``addressed``): a param or shard the job replaced is
    still allocated, and the replay reads stale but valid memory, which the fingerprint then
    rejects (``verify_weights`` does not read that replay). What the plan's references cannot
    keep alive is storage freed in place (``set_``, ``.data =``, a storage resized to 0): that
    changes an address, which is compared first, in one C loop."""
    try:
        layout = _PLANS.get(optimizer)
    except TypeError:
        return None
    plan = layout.plans.get(key) if layout is not None else None
    if plan is None or not plan.check.replayable():
        return None
    try:
        if list(map(_DATA_PTR, layout.addressed)) != layout.pointers:  # type: ignore[union-attr]
            return None
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    plan.check.restart(report, offset)
    plan.check.launch()
    return plan


def _layout_of(optimizer: Any, fingerprint: tuple[Any, ...], addressed: list[torch.Tensor]) -> _Layout | None:
    """What is kept for this layout, or None where nothing can be kept."""
    if not fingerprint:
        return None
    try:
        layout = _PLANS.get(optimizer)
        if layout is None or layout.fingerprint != fingerprint:
            pointers = list(map(_DATA_PTR, addressed))
            layout = _PLANS[optimizer] = _Layout(fingerprint, addressed=addressed, pointers=pointers)
    except TypeError:  # not weakly referenceable: nothing is kept
        return None
    return layout


def _fingerprint(chunks: list[Any], optimizer: Any, addressed: list[Any] | None = None) -> tuple[Any, ...]:
    """Which tensors, at which addresses, a plan reads: every buffer param (the codes, scales or
    per-tensor FP8 bytes it holds) and every main shard. A plan is reused only while this is
    unchanged, so its views never read memory the params or the optimizer have moved away from.
    Empty where it cannot be taken (nothing is then reused).

    Taken at every check, so it is built as cheaply as Python allows: on one H200 it was most of
    a replayed sampled check's host time (0.3-0.6 ms of 1.0-1.2 ms at 1B, 120 params). The
    tensors are listed first, then addressed in C loops (``map``): the objects, and their first
    elements' pointers (``data_ptr`` includes the storage offset, so a moved view or a swapped
    storage changes it). ``addressed`` receives the tensors whose pointers it took."""
    parts: list[Any] = []
    add = parts.append
    tensors: list[Any] = []
    try:
        # One subclass-dispatch guard for the whole walk: entered per tensor it cost more than
        # the reads.
        with torch._C.DisableTorchFunctionSubclass():
            for param in _params_of(chunks):
                kind = type(param)
                add(kind)
                add(param.shape)
                tensors.append(param)
                own = param.__dict__
                if kind in _PLAIN and _ATTRS.isdisjoint(own):
                    tensors.extend(_NO_HELD)  # a plain param holds none of them (no lookups that miss)
                    parts.extend(_NO_LAYOUT)
                    continue
                declared = _DECLARED.get(kind)
                if declared is None:
                    declared = _DECLARED[kind] = _declared(kind)
                if declared:  # a property, a slot, a class default, __getattr__: ask getattr
                    tensors.extend(getattr(param, name, None) for name in _HELD_ATTRS)
                    parts.extend(getattr(param, name, None) for name in _LAYOUT_ATTRS)
                else:  # instance attributes only: the dict answers, a miss without an exception
                    tensors.extend(map(own.get, _HELD_ATTRS))
                    parts.extend(map(own.get, _LAYOUT_ATTRS))
            tensors.extend(main_params(optimizer))
            parts.extend(map(id, tensors))
            parts.extend(_pointers(tensors, addressed))
    except (AttributeError, TypeError, RuntimeError):
        return ()
    return tuple(parts)


def _pointers(tensors: list[Any], addressed: list[Any] | None = None) -> list[int]:
    """``data_ptr`` of every tensor with storage, in order (None, and types seen without
    storage, are left out; their objects are in the fingerprint already); those tensors are
    appended to ``addressed``."""
    no_storage = _NO_STORAGE
    if no_storage:
        kept = [t for t in tensors if t is not None and type(t) not in no_storage]
    else:
        kept = [t for t in tensors if t is not None]
    try:
        out = list(map(_DATA_PTR, kept))
    except (RuntimeError, NotImplementedError, TypeError):  # a storage-less wrapper, a non-tensor
        out, fine = [], []
        for tensor in kept:
            try:
                out.append(_DATA_PTR(tensor))
                fine.append(tensor)
            except (RuntimeError, NotImplementedError, TypeError):
                if isinstance(tensor, torch.Tensor) and type(tensor) not in _PLAIN:
                    no_storage.add(type(tensor))
        kept = fine
    if addressed is not None:
        addressed.extend(kept)
    return out


_REGISTRY_ATTRS = ("HAVE_TE_FP8_TENSOR_CLASS", "FP8_TENSOR_CLASS", "HAVE_TE_MXFP8TENSOR", "MXFP8Tensor")
_LAYOUT_ATTRS = ("_fp8_dtype", "_with_gemm_swizzled_scales", "_quantizer")
#: The tensors a quantized param holds that the check reads or folds (``read``, ``replica``).
_HELD_ATTRS = ("_rowwise_data", "_rowwise_scale_inv", "_data", "_scale_inv")


#: Param types that hold values only: none of the attributes above unless set on the instance.
_PLAIN = (torch.nn.Parameter, torch.Tensor)
_ATTRS = frozenset(_HELD_ATTRS + _LAYOUT_ATTRS)
#: What a param without those attributes lists for them.
_NO_HELD: tuple[None, ...] = (None,) * len(_HELD_ATTRS)
_NO_LAYOUT: tuple[None, ...] = (None,) * len(_LAYOUT_ATTRS)
_DATA_PTR = torch.Tensor.data_ptr
#: Per param type, which of those names its class declares (a property, a slot, a class default),
#: or all of them where it resolves names itself (``__getattr__``).
_DECLARED: dict[type, frozenset[str]] = {}


def _declared(kind: type) -> frozenset[str]:
    if any("__getattr__" in vars(k) for k in kind.__mro__ if k is not object):
        return _ATTRS
    return frozenset(n for n in _ATTRS if any(n in vars(k) for k in kind.__mro__))


#: Tensor subclasses seen without storage (wrapper subclasses): addressed by object alone, so
#: their ``data_ptr`` is not asked (and refused) again at every check.
_NO_STORAGE: set[type] = set()


def _make_plan(
    chunks: list[Any],
    optimizer: Any,
    report: WeightReport,
    atol: float,
    stride: int,
    offset: int,
    layout: _Layout,
) -> _Plan:
    if layout.owned is None:
        layout.owned = _owned_shards(optimizer)
    owned, report.note = layout.owned
    budget = _BUDGET_BYTES
    probed = layout.probed.setdefault(budget, Probed())
    check = ShardCheck(report, atol, stride, offset, budget, probed)
    plan = _Plan(check, report.note, [])
    _walk(chunks, owned, plan, layout)
    plan.unchecked = list(report.unchecked)
    plan.unchecked_mxfp8 = (report.mxfp8_unchecked, list(report.unchecked_types))
    return plan


def _walk(chunks: list[Any], owned: dict[Any, Owned], plan: _Plan, layout: _Layout) -> None:
    """Queue every owned param's blocks for the shard check and list every replicated param's
    fold sources (the device the folds live on goes into ``plan``)."""
    from megatron.core import fp8_utils

    check = plan.check
    if layout.names is None:
        layout.names = {
            p: (f"{c}." if len(chunks) > 1 else "") + n
            for c, ch in enumerate(chunks)
            for n, p in ch.named_parameters()
        }
    names = layout.names
    sizes: dict[int, int] = {}
    with torch.no_grad():  # views of params and main shards, no autograd bookkeeping
        for group, param in _buffer_params(chunks):
            if id(group) not in sizes:
                sizes[id(group)] = group_size(group)
            replicated = sizes[id(group)] > 1  # a group of one has no replica: no fold
            if param not in owned and not replicated:
                continue
            name = names.get(param) or f"<param {tuple(param.shape)}>"
            source: list[torch.Tensor] | None = None
            try:
                fp8 = fp8_utils.is_float8tensor(param)
                mxfp8 = fp8_utils.is_mxfp8tensor(param)
                reader = layout.readers.get(id(param))
                if reader is None:
                    reader = layout.readers[id(param)] = reader_for(param) if fp8 else Reader(_plain(param))
                own = owned.get(param)
                if own is not None:
                    reason = _unchecked_reason(param, own, fp8, mxfp8)
                    reason = reason or (reader if isinstance(reader, str) else "")
                    if reason:
                        check.report.add_unchecked(name, reason, type(param).__name__ if mxfp8 else "")
                    else:
                        check.add(name, param, reader, own, mxfp8)  # type: ignore[arg-type]
                if replicated:
                    source = fold_sources(param, reader)
                    plan.device = source[0].device
            except Exception as exc:  # noqa: BLE001 - a rank must still join the all-reduce
                quantized = _is_quantized(param)
                check.report.add_unchecked(
                    name, f"{type(exc).__name__}: {exc}", type(param).__name__ if quantized else ""
                )
                check.reusable = False
            if replicated:
                plan.replicated.append((group, name, source))


def _is_quantized(param: Any) -> bool:
    """Whether megatron-core calls ``param`` MXFP8, asked again where the walk itself failed."""
    from megatron.core import fp8_utils

    try:
        return bool(fp8_utils.is_mxfp8tensor(param))
    except Exception:  # noqa: BLE001 - unknown is counted as an MXFP8 weight: never a silent pass
        return True


def _plain(param: Any) -> torch.Tensor:
    """The param's storage as a plain flat tensor (no subclass dispatch on the views taken)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.reshape(param.detach(), -1)
