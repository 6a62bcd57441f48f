"""Rank cases of the verifier on params holding codes and scales, in every ranks pass (issue 32.5).

Run from :func:`harness.verify_cases.verify_rank` in the session's one verifier launch. The other
cases build the kind ``MXFP8_PARAM_KIND`` selects (the kit's value-holding type by default), where
the fused kernel and the scale bytes never come into play; this one builds the kit's TE-shaped
type (codes, E8M0 bytes, a quantizer) whatever the pass, with weight rows of 256 and 128 elements
(a multiple of 128: scale rows without tile padding, as in real models), so the default pass too
runs the fused kernel on real megatron-core shards, reads sampled scales at stride 16, and folds
scale bytes for the replica check. Beside it, a case where only rank 0's owned shard differs and
the replicas agree: rank 1 learns of it only from the mismatch count the all-reduce carries.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from .verify_loop import ITERS, train

__all__ = ["case_codes", "case_peer", "case_rotation"]

#: Weights (128, 256), (128, 128), (32, 128): rows of 256 and 128 elements.
DIMS = (256, 128, 128, 32)


def _whole_row_slices(job: Any) -> list[tuple[str, Any, int, int]]:
    """(name, param, start, end) of this rank's owned slices of TE-shaped weights whose rows are
    a multiple of 128 elements and that hold at least one whole row, by name."""
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    owned, _ = _owned_shards(job.optimizer)
    names = {p: n for n, p in job.model[0].named_parameters()}
    out = []
    for p, o in owned.items():
        if hasattr(p, "_rowwise_data") and p.shape[-1] % 128 == 0 and o.end - o.start >= 2 * p.shape[-1]:
            out.append((names[p], p, o.start, o.end))
    return sorted(out, key=lambda t: (-t[1].shape[-1], t[0]))


def _scale_of_first_whole_row(param: Any, start: int) -> tuple[int, int]:
    """(row, column) of the scale byte of block 3 of the first whole row from ``start``."""
    last = param.shape[-1]
    return -(-start // last), 3


@contextlib.contextmanager
def _te_shaped() -> Iterator[None]:
    """The toy builds its MXFP8 weights as the kit's TE-shaped type, registered with core, whatever
    the pass's ``MXFP8_PARAM_KIND``; the pass's kind again after."""
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import te_shaped_mxfp8

    saved = os.environ.get("MXFP8_PARAM_KIND")
    os.environ["MXFP8_PARAM_KIND"] = "te"
    try:
        with te_shaped_mxfp8():
            yield
    finally:
        if saved is None:
            os.environ.pop("MXFP8_PARAM_KIND", None)
        else:
            os.environ["MXFP8_PARAM_KIND"] = saved


def _checks(job: Any, event: str) -> dict[str, Any]:
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE

    stride = round(1 / DEFAULT_VERIFY_SAMPLE)
    return {
        "full": verify_weights(job.model, job.optimizer, event=event, sample=1.0),
        "sampled": [verify_weights(job.model, job.optimizer, event=event, offset=i) for i in range(stride)],
    }


def case_codes() -> dict[str, Any]:
    """The kit's TE-shaped type, rows of 256 / 128 elements. Current weights: the full check and
    every phase of the default sample are silent, judged by the fused kernel where it can run.
    One scale byte of a sampled block in rank 0's slice (its codes untouched): rank 0's full check
    names it, exactly one phase of 16 of the sampled check names it, and every rank's replica
    check names it. One scale byte drifts on rank 1 only, in a block of rank 0's slice: no shard
    check sees it, every rank's replica check must."""
    rank = torch.distributed.get_rank()
    rec: dict[str, Any] = {}
    with _te_shaped():
        job = _te_job()
        rec["clean"] = _checks(job, "codes clean")
        mine = _whole_row_slices(job)
        picked = None
        if mine:
            name, param, start, _ = mine[0]
            picked = (name, *_scale_of_first_whole_row(param, start))
        picks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(picks, picked)
        assert picks[0] is not None, "rank 0 owns no whole row of a 128k-row TE-shaped weight"
        name, row, col = picks[0]
        param = dict(job.model[0].named_parameters())[name]
        per_row = param.shape[-1] // 32
        rec["scale_name"], rec["scale_block"] = name, row * per_row + col
        scales = param._rowwise_scale_inv
        if rank == 0:
            scales[row, col] += 1  # every element of that block doubles; no code bit changes
        rec["scale"] = _checks(job, "codes scale")
        if rank == 0:
            scales[row, col] -= 1
        rec["restored"] = _checks(job, "codes restored")["full"]
        if rank == 1:
            scales[row, col] += 1  # rank 1's copy drifts where rank 0 owns the block
        rec["drift"] = _checks(job, "codes drift")["full"]
        if rank == 1:
            scales[row, col] -= 1
        rec["job"] = job
    return rec


def _te_job() -> Any:
    """A TE-shaped job (rows of 256 and 128 elements) after a few steps, its weights current."""
    from mbridge_mxfp8_plugin import ensure_weights_current
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig(dims=DIMS))
    train(job, ITERS)
    ensure_weights_current(job.model, job.optimizer)
    return job


def _blind_offsets(job: Any) -> list[int]:
    """The sampled calls (offsets 0..stride-1) whose partial re-read of the layout still finds the
    kept one: those the rotation leaves blind to what changed since it was kept."""
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE
    from mbridge_mxfp8_plugin.verify import weights
    from mbridge_mxfp8_plugin.verify.fingerprint import unchanged

    stride = round(1 / DEFAULT_VERIFY_SAMPLE)
    kept = weights._PLANS[job.optimizer].fingerprint
    chunks = weights._model_chunks(job.model)
    return [o for o in range(stride) if unchanged(kept, chunks, job.optimizer, (o, stride))]


def case_rotation() -> dict[str, Any]:
    """A sampled check re-reads at every call what its plan reads and how it reads it, and only
    the rest in rotation (verify/fingerprint.py ``unchanged``). On the kit's TE-shaped type, every
    rank alike, at a weight rank 0 owns whole rows of:

    * ``rebound``: its codes re-bound to a copy whose every bit is then flipped (the model computes
      with the copy). No sampled call is blind to it; the next one says WRONG (a plan still reading
      the old codes would say OK).
    * ``swizzled``: marked as holding GEMM-swizzled scales (the mark it had, set), its scale bytes
      changed in place: a layout the check does not read. No sampled call is blind to it; the next
      one says NOT CHECKED where the weight is owned (a plan still reading the bytes as plain
      scales would say WRONG).
    Each is undone after, and the check is OK again."""
    from mbridge_mxfp8_plugin import verify_weights

    rec: dict[str, Any] = {}
    with _te_shaped():
        job = _te_job()
        rec["warm"] = verify_weights(job.model, job.optimizer, event="rotation warm", offset=0)
        mine = _whole_row_slices(job)
        names: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, mine[0][0] if mine else None)
        rec["name"] = name = names[0]  # rank 0's: every rank changes the same weight
        param = dict(job.model[0].named_parameters())[name]
        rec["owner"] = _owns(job, param)
        codes = param._rowwise_data
        with torch.no_grad():
            param._rowwise_data = codes.clone().bitwise_xor_(0x01)
        rec["rebound_blind"] = _blind_offsets(job)
        rec["rebound"] = verify_weights(job.model, job.optimizer, event="rebound", offset=1)
        param._rowwise_data = codes
        rec["rebound_back"] = verify_weights(job.model, job.optimizer, event="rebound back", offset=2)
        scales = param._rowwise_scale_inv
        param._with_gemm_swizzled_scales = True
        with torch.no_grad():
            scales.add_(1)
        rec["swizzled_blind"] = _blind_offsets(job)
        rec["swizzled"] = verify_weights(job.model, job.optimizer, event="swizzled", offset=3)
        param._with_gemm_swizzled_scales = False
        with torch.no_grad():
            scales.sub_(1)
        rec["swizzled_back"] = verify_weights(job.model, job.optimizer, event="swizzled back", offset=4)
    return rec


def _owns(job: Any, param: Any) -> bool:
    """Whether this rank owns a shard of ``param`` (its shard check compares it)."""
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    owned, _ = _owned_shards(job.optimizer)
    return param in owned and owned[param].end > owned[param].start


def case_peer() -> dict[str, Any]:
    """Rank 0's fp32 main shard of its largest owned slice moves by 1.0 after the weights were
    made current (what an optimizer step whose gather never came does to one rank's shard): the
    params stay alike on both replicas, so the replica check sees nothing; rank 0's shard check
    finds it, and rank 1, whose own shard is current, learns of it only from the count the
    all-reduce carries (``peer_mismatch_count``). Full and default sample."""
    from mbridge_mxfp8_plugin import ensure_weights_current, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    job = build_job(ToyConfig())
    train(job, ITERS)
    ensure_weights_current(job.model, job.optimizer)
    rec: dict[str, Any] = {"clean": verify_weights(job.model, job.optimizer, event="peer clean", sample=1.0)}
    owned, _ = _owned_shards(job.optimizer)
    own = max(owned.values(), key=lambda o: o.end - o.start)
    saved = own.main.detach().clone()
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            own.main.add_(1.0)
    rec["full"] = verify_weights(job.model, job.optimizer, event="peer", sample=1.0)
    rec["sampled"] = verify_weights(job.model, job.optimizer, event="peer")
    with torch.no_grad():
        own.main.copy_(saved)
    rec["restored"] = verify_weights(job.model, job.optimizer, event="peer restored", sample=1.0)
    rec["job"] = job
    return rec
