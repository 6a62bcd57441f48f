"""``verify_weights``: one call, on every rank at the same point; reads, never writes."""

from __future__ import annotations

import contextlib
import gc
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
    main_shards,
)
from ..options import DEFAULT_VERIFY_SAMPLE
from .batches import Owned
from .fingerprint import DATA_PTR, Fingerprint, fingerprint, unchanged
from .probe import Probed
from .read import Reader, reader_for
from .replica import fold_sources, group_size, reduce_folds, row_sums
from .report import WeightReport
from .sampling import stride_of
from .shard import ShardCheck
from .triton_startup import wait as _startup_done

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

    fingerprint: Fingerprint
    plans: dict[tuple[Any, ...], _Plan] = field(default_factory=dict)
    owned: tuple[dict[Any, Owned], str] | None = None
    names: dict[int, str] | None = None  # id(param) -> its name (``_param_names``)
    readers: dict[int, Reader | str] = field(default_factory=dict)
    probed: dict[int, Probed] = field(default_factory=dict)  # by budget: it sets the capacities
    #: (stride, atol) -> the key of the plan the last such call used: the plan a later call
    #: launches before it has found the model's chunks (``_replay_early``)
    last: dict[tuple[int, float], tuple[Any, ...]] = field(default_factory=dict)


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


def _param_names(chunks: list[Any]) -> dict[int, str]:
    """id(param) -> the name ``named_parameters`` gives it, prefixed with its chunk's index
    where there are several (a later chunk's name wins). Keyed by identity: the walk looks every
    param up, and a tensor's hash is a Python call."""
    prefix = len(chunks) > 1
    return {
        id(p): (f"{c}." if prefix else "") + n
        for c, ch in enumerate(chunks)
        for n, p in ch.named_parameters()
    }


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
    _startup_done()  # no kernel launch while Triton's background start-up runs (``triton_startup``)
    stride = stride_of(sample)
    if offset is None:
        offset = next(_CALLS)
    with _collector_paused():
        # The last plan of this sample and tolerance is launched first, before even this call's
        # report is made, so that everything else the host does (the report, finding the
        # chunks, the plan's key, re-reading the layout) overlaps it.
        early, moved = _replay_early(optimizer, (stride, atol), offset)
        report = WeightReport(event=event, sample=1.0 / stride, accept_unchecked=accept_unchecked)
        _check(report, model_chunks, optimizer, atol, max_names, stride, offset, early, moved)
    report.seconds = time.perf_counter() - t0
    return report


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for one check. A plan's first call allocates tens of
    thousands of small objects (its geometry, batches, views) and keeps most of them: the passes
    of the collector they trigger walk the whole job's heap (megatron-core's modules, torch's),
    which was a third of a first call's host time on a toy job, and grows with the job. Nothing
    is lost: what it would have freed is freed at its next pass, after the check."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _check(
    report: WeightReport,
    held: Sequence[Any] | Any,
    optimizer: Any,
    atol: float,
    max_names: int,
    stride: int,
    offset: int,
    early: _Plan | None,
    moved: bool | None,
) -> None:
    """The check of one call; ``early``, ``moved``: what ``_replay_early`` launched and found."""
    from megatron.core import fp8_utils

    chunks = _model_chunks(held)
    # What else a plan depends on: the budget, the quantized types core recognises. Not the
    # sampled phase: that is data the plan is run with (``ShardCheck.restart``).
    registered = tuple(getattr(fp8_utils, a, None) for a in _REGISTRY_ATTRS)
    budget = _BUDGET_BYTES
    key = (tuple(id(c) for c in chunks), stride, atol, budget, registered)
    layout, plan = _kept_plan(chunks, optimizer, key, report, offset, stride, early, moved)
    plans = layout.plans if layout is not None else None
    if plan is not None:
        report.unchecked.extend(plan.unchecked)
        report.mxfp8_unchecked, report.unchecked_types = (
            plan.unchecked_mxfp8[0],
            list(plan.unchecked_mxfp8[1]),
        )
        report.note = plan.note
    else:
        plan = _make_plan(chunks, optimizer, report, atol, stride, offset, layout or _Layout(Fingerprint()))
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
        layout.last[(stride, atol)] = key  # type: ignore[union-attr]
    report.params_hashed = sum(len(v[1]) for v in hashes.values())
    reduce_folds(hashes, report, max_names, plan.device)


def _kept_plan(
    chunks: list[Any],
    optimizer: Any,
    key: tuple[Any, ...],
    report: WeightReport,
    offset: int,
    stride: int,
    early: _Plan | None,
    moved: bool | None,
) -> tuple[_Layout | None, _Plan | None]:
    """This layout's kept state, and its plan of ``key`` ready for this call (None: none kept).
    ``early``, launched already (``_replay_early``), is read only if it is that plan and the
    layout holds: the same objects at the same addresses (:func:`unchanged`; a sampled check
    re-reads what no framework changes on a live param in rotation, one param in ``stride`` per
    call), else a new fingerprint equal to the kept one. The rotation is the sampled blocks'
    (``offset``): the same on every rank, so replicas drop a plan at the same call. ``moved``:
    whether a tensor the plan reads was found at another address just now (nothing was then
    launched); None where the addresses were not read."""
    try:
        layout = _PLANS.get(optimizer)
    except TypeError:  # not weakly referenceable: nothing is kept
        layout = None
    part = (offset % stride, stride)
    read = moved is False
    if layout is None or moved or not unchanged(layout.fingerprint, chunks, optimizer, part, read):
        layout = _layout_of(optimizer, fingerprint(chunks, optimizer))
    plan = layout.plans.get(key) if layout is not None else None
    if early is not None and early is not plan:  # the layout or the key changed: not read
        early.check.abandon()
    if plan is not None and plan is early:
        plan.check.attach(report)
    elif plan is not None:
        plan.check.restart(report, offset)
    return layout, plan


def _replay_early(optimizer: Any, which: tuple[int, float], offset: int) -> tuple[_Plan | None, bool | None]:
    """The plan the last call of this sample and tolerance (``which``) used, its graph launched
    at this call's phase before anything else, so that the GPU compares while the host finds
    the chunks and re-reads the layout (most of a replayed check's host time); None where there
    is no graph to launch. With it, whether a tensor the plan reads is at another address: False
    (the addresses were read and hold: the layout's re-read need not read them again), True
    (nothing launched), None (not read).

    Launching before knowing the layout is unchanged is safe because the plan holds every tensor
    its graph reads (its views, the fingerprint's ``addressed``): a param or shard the job
    replaced is still allocated, and the replay reads stale but valid memory, which the layout's
    check then rejects (``verify_weights`` does not read that replay). What the plan's
    references cannot keep valid is a tensor re-pointed or freed in place (``set_``, ``.data =``,
    a storage resized to 0): the kernels' tables address the batch's tensors from their first
    one, so that changes an address, compared first, in one C loop."""
    try:
        layout = _PLANS.get(optimizer)
    except TypeError:
        return None, None
    key = layout.last.get(which) if layout is not None else None
    plan = layout.plans.get(key) if layout is not None and key is not None else None
    if plan is None or not plan.check.replayable():
        return None, None
    taken = layout.fingerprint  # type: ignore[union-attr]
    try:
        if list(map(DATA_PTR, taken.addressed)) != taken.pointers:
            return None, True
    except (RuntimeError, NotImplementedError, TypeError):
        return None, True
    plan.check.launch(offset)
    return plan, False


def _layout_of(optimizer: Any, taken: Fingerprint) -> _Layout | None:
    """What is kept for this layout (its fingerprint ``taken``), or None where nothing can be
    kept. An equal fingerprint keeps the layout and its plans, and becomes the one kept: its
    objects are those the next call's :func:`unchanged` compares (a value-equal attribute in a
    new object would otherwise send every call to a new fingerprint)."""
    if not taken:
        return None
    try:
        layout = _PLANS.get(optimizer)
        if layout is None or layout.fingerprint != taken:
            layout = _PLANS[optimizer] = _Layout(taken)
        else:
            layout.fingerprint = taken
    except TypeError:  # not weakly referenceable: nothing is kept
        return None
    return layout


_REGISTRY_ATTRS = ("HAVE_TE_FP8_TENSOR_CLASS", "FP8_TENSOR_CLASS", "HAVE_TE_MXFP8TENSOR", "MXFP8Tensor")


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
        layout.names = _param_names(chunks)
    names = layout.names
    sizes: dict[int, int] = {}
    with torch.no_grad():  # views of params and main shards, no autograd bookkeeping
        for group, param in _buffer_params(chunks):
            if id(group) not in sizes:
                sizes[id(group)] = group_size(group)
            replicated = sizes[id(group)] > 1  # a group of one has no replica: no fold
            if param not in owned and not replicated:
                continue
            name = names.get(id(param)) or f"<param {tuple(param.shape)}>"
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
