"""The weight verifier judges every MXFP8 param type by the type's own write path.

Three emulations train the same toy job with the plugin on real megatron-core over 2 gloo ranks:
the kit's value-holding one and its TE-shaped one (codes and scales, a ``_quantizer``), both on
Transformer Engine's scale rule, and a third written apart from the kit with the OCP MX spec's
rule (``tests/harness/ocp_mxfp8.py``). For each: the full check (``verify_sample=1.0``, strict) at
the first eval and at a later one, and after a load-like re-quantization of every param, must
be silent; stale weights, one corrupted block and one rank's drifted copy must be caught on
every rank and named. The OCP case also shows why this needs the type's own path: TE's rule
applied to its main params disagrees with its weights (what the verifier used to assume).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.testing import launch

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)

KINDS = ("values", "te", "ocp")
ITERS = 3


def _train(job: Any, sync: Any, iters: int, salt: int) -> None:
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step
    from mbridge_mxfp8_plugin.testing.toy import make_batches

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for it in range(iters):
        sync.step_started()
        ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=salt + it)
        train_step(job, x, y)
        if salt == 0 and it == 0:
            for chunk in job.model:
                chunk.enable_forward_pre_hook()


def _eval(job: Any, sync: Any) -> Any:
    for chunk in job.model:
        chunk.disable_forward_pre_hook()  # the loop's forced all-gather
    sync.last_report = None
    sync.before_eval()
    report = sync.last_report
    for chunk in job.model:
        chunk.enable_forward_pre_hook()
    sync.after_eval()
    return report


def _mxfp8_slices(job: Any) -> list[tuple[str, Any, int, int]]:
    """(name, param, start, end) of this rank's owned slices of 2-D MXFP8 weights holding a whole row."""
    from megatron.core import fp8_utils

    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    owned, _ = _owned_shards(job.optimizer)
    names = {p: n for n, p in job.model[0].named_parameters()}
    out = []
    for p, o in owned.items():
        if fp8_utils.is_mxfp8tensor(p) and p.dim() == 2 and o.end - o.start >= 2 * p.shape[-1] + 32:
            out.append((names[p], p, o.start, o.end))
    return sorted(out, key=lambda t: t[0])


def _flip_block(param: Any, start: int) -> None:
    """Negate the 32 elements from flat element ``start`` where the param keeps them."""
    with torch.no_grad():
        codes = getattr(param, "_rowwise_data", None)
        if codes is not None:
            codes.view(-1)[start : start + 32].bitwise_xor_(0x80)  # the E4M3 sign bit
            return
        with torch._C.DisableTorchFunctionSubclass():
            param.data.view(-1)[start : start + 32].neg_()


def _te_rule_disagrees(job: Any) -> int:
    """Elements of owned MXFP8 slices where TE's rule, applied to the main shard, differs from the
    weights the job computes with (0 for a type that follows TE's rule)."""
    from mbridge_mxfp8_plugin.common.mxfp8_cast import mxfp8_quantize
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    owned, _ = _owned_shards(job.optimizer)
    count = 0
    for _, p, s, e in _mxfp8_slices(job):
        last = p.shape[-1]
        r0, r1 = -(-s // last), e // last  # whole rows inside the slice
        main = owned[p].main.detach().reshape(-1)[r0 * last - s : r1 * last - s].view(-1, last)
        te = mxfp8_quantize(main.to(torch.bfloat16)).to(torch.bfloat16)
        got = p.dequantize() if hasattr(p, "_rowwise_data") else p.detach()
        with torch._C.DisableTorchFunctionSubclass():
            got = torch.Tensor.reshape(got, -1)[r0 * last : r1 * last].view(-1, last)
        count += int((te != got).sum())
    return count


@contextlib.contextmanager
def _small_batches() -> Iterator[None]:
    """The smallest batches (32 blocks): params are split across batches, as in a large model."""
    from mbridge_mxfp8_plugin.verify import weights

    saved = weights._BUDGET_BYTES
    weights._BUDGET_BYTES = 1
    try:
        yield
    finally:
        weights._BUDGET_BYTES = saved


@contextlib.contextmanager
def _swizzled(job: Any) -> Iterator[bool]:
    """Mark the TE-shaped params' scales as swizzled for the GEMM (a layout the check does not
    read); yields whether there were any."""
    params = [p for p in job.model[0].parameters() if hasattr(p, "_rowwise_data")]
    for p in params:
        p._with_gemm_swizzled_scales = True
    try:
        yield bool(params)
    finally:
        for p in params:
            del p._with_gemm_swizzled_scales


def _scenario() -> dict[str, Any]:
    from mbridge_mxfp8_plugin import PluginOptions, ensure_weights_current, mxfp8_param_sync, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    rank = torch.distributed.get_rank()
    job = build_job(ToyConfig())
    options = PluginOptions(verify_weights=True, verify_sample=1.0, strict=True)
    sync = mxfp8_param_sync(job.model, job.optimizer, options)
    for chunk in job.model:
        chunk.disable_forward_pre_hook(param_sync=False)
    out: dict[str, Any] = {}
    _train(job, sync, ITERS, 0)
    out["eval1"] = _eval(job, sync)
    _train(job, sync, 2, 100)
    out["eval2"] = _eval(job, sync)
    out["te_rule_disagrees"] = _te_rule_disagrees(job)
    # A checkpoint load re-quantizes the saved bf16 values: bytes may change, values must not.
    with torch.no_grad():
        for p in job.model[0].parameters():
            p.data.copy_(p.dequantize() if hasattr(p, "dequantize") else p.detach().clone())
    out["reloaded"] = verify_weights(job.model, job.optimizer, event="reloaded", sample=1.0)
    _train(job, sync, 1, 200)  # an optimizer step: the weights are now stale everywhere
    out["stale"] = verify_weights(job.model, job.optimizer, event="stale", sample=1.0)
    ensure_weights_current(job.model, job.optimizer)
    out["current"] = verify_weights(job.model, job.optimizer, event="current", sample=1.0)
    with _small_batches():
        out["current_small_batches"] = verify_weights(job.model, job.optimizer, event="current", sample=1.0)
    mine = _mxfp8_slices(job)
    picked = None
    if mine:  # the first block of the first whole row of this rank's first such slice
        name, param, start, _ = mine[0]
        picked = (name, -(-start // param.shape[-1]) * param.shape[-1])
    picks: list[Any] = [None, None]
    torch.distributed.all_gather_object(picks, picked)
    assert picks[0] is not None, "rank 0 owns no whole row of an MXFP8 weight in the toy job"
    # One corrupted block on rank 0, inside its own slice: its shard check and every rank's
    # replica check must see it.
    corrupt_name, corrupt_at = picks[0]
    target = dict(job.model[0].named_parameters())[corrupt_name]
    if rank == 0:
        _flip_block(target, corrupt_at)
    out["corrupt_name"] = corrupt_name
    out["corrupt"] = verify_weights(job.model, job.optimizer, event="corrupt", sample=1.0)
    with _small_batches():
        out["corrupt_small_batches"] = verify_weights(job.model, job.optimizer, event="corrupt", sample=1.0)
    if rank == 0:
        _flip_block(target, corrupt_at)  # undone
    with _swizzled(job) as swizzled:  # a layout the check does not read: unchecked, not wrong
        out["swizzled"] = swizzled and verify_weights(job.model, job.optimizer, event="swz", sample=1.0)
        # The same call again reuses the plan: still unchecked, with the same reasons.
        out["swizzled_again"] = swizzled and verify_weights(job.model, job.optimizer, event="swz", sample=1.0)
        out["swizzled_accepted"] = swizzled and verify_weights(
            job.model, job.optimizer, event="swz", sample=1.0, accept_unchecked=True
        )
    # One rank's copy drifts where it owns nothing (rank 1 changes a block of rank 0's slice):
    # only the replica check can see it.
    if rank == 1:
        _flip_block(target, corrupt_at)
    out["drift"] = verify_weights(job.model, job.optimizer, event="drift", sample=1.0)
    with _swizzled(job) as swizzled:  # the replica check still folds the codes
        out["swizzled_drift"] = swizzled and verify_weights(job.model, job.optimizer, event="swz", sample=1.0)
    out["job"] = job
    return out


def _rank() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from harness.ocp_mxfp8 import ocp_mxfp8

    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    results: dict[str, Any] = {}
    for kind in KINDS:
        os.environ["MXFP8_PARAM_KIND"] = "te" if kind == "te" else "values"
        registered = ocp_mxfp8() if kind == "ocp" else emulated_mxfp8()
        with cpu_shim(), registered:
            results[kind] = _scenario()
        results[kind].pop("job")
    os.environ.pop("MXFP8_PARAM_KIND", None)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_rank, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_silent_on_correct_weights_at_every_eval(runs: list[dict[str, Any]], kind: str) -> None:
    for r in runs:
        case = r[kind]
        for event in ("eval1", "eval2", "reloaded", "current", "current_small_batches"):
            rep = case[event]
            assert rep is not None and rep.ok, (kind, event, rep and rep.message())
            assert rep.params_checked > 0 and rep.sample == 1.0 and not rep.unchecked, (kind, rep.unchecked)


def test_the_ocp_type_breaks_the_te_rule(runs: list[dict[str, Any]]) -> None:
    """The control: a check that assumed TE's rule would cry wolf on the OCP type."""
    assert sum(r["ocp"]["te_rule_disagrees"] for r in runs) > 0
    assert all(r[kind]["te_rule_disagrees"] == 0 for r in runs for kind in ("values", "te"))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_paths_are_the_types_own(runs: list[dict[str, Any]], kind: str) -> None:
    type_name = {"values": "EmulatedMXFP8Tensor", "te": "TEShapedMXFP8Tensor", "ocp": "OCPMXFP8Tensor"}[kind]
    for r in runs:
        paths = r[kind]["eval1"].reference_paths
        assert any(p.startswith(type_name + " via ") for p in paths), paths
        assert any(("codes" in p) == (kind == "te") for p in paths if p.startswith(type_name)), paths


@pytest.mark.parametrize("kind", KINDS)
def test_stale_weights_caught_and_named_on_every_rank(runs: list[dict[str, Any]], kind: str) -> None:
    for r in runs:
        rep = r[kind]["stale"]
        assert not rep.ok and rep.shard_mismatch_count > 0 and rep.shard_mismatches, rep.message()


@pytest.mark.parametrize("kind", KINDS)
def test_one_corrupted_block_caught_and_named_on_every_rank(runs: list[dict[str, Any]], kind: str) -> None:
    name = runs[0][kind]["corrupt_name"]
    for rank, r in enumerate(runs):
        for event in ("corrupt", "corrupt_small_batches"):
            rep = r[kind][event]
            assert not rep.ok and name in rep.message(), rep.message()
            assert rep.replica_mismatches == [name], rep.message()
            if rank == 0:  # the owner's shard check sees it too, and only in that block
                assert [m.name for m in rep.shard_mismatches] == [name]
                assert 0 < rep.shard_mismatches[0].elements <= 32


@pytest.mark.parametrize("kind", KINDS)
def test_one_rank_drift_caught_and_named_on_every_rank(runs: list[dict[str, Any]], kind: str) -> None:
    name = runs[0][kind]["corrupt_name"]
    for r in runs:
        rep = r[kind]["drift"]
        assert not rep.ok and rep.replica_mismatches == [name], rep.message()
        assert rep.shard_mismatch_count == 0  # neither owner's slice changed


def test_an_unreadable_layout_is_not_checked_never_wrong_and_never_ok(runs: list[dict[str, Any]]) -> None:
    """TE-shaped params whose scales claim a GEMM-swizzled layout: every MXFP8 weight listed
    unchecked with the reason, and the verdict NOT CHECKED, which is neither WRONG nor a pass
    (``ok`` false, ``raise_if_bad`` raises) unless accepted; the reused plan says the same; a
    drifted replica is still found through the codes."""
    from mbridge_mxfp8_plugin.errors import MXFP8PluginError

    name = runs[0]["te"]["corrupt_name"]
    for r in runs:
        rep = r["te"]["swizzled"]
        assert rep.verdict == "not checked" and not rep.ok and rep.shard_mismatch_count == 0, rep.message()
        assert rep.unchecked and all("swizzled" in line for line in rep.unchecked), rep.unchecked
        assert rep.mxfp8_unchecked == len(rep.unchecked) and rep.unchecked_types == ["TEShapedMXFP8Tensor"]
        assert "NOT CHECKED" in rep.message() and "OK" not in rep.message(), rep.message()
        with pytest.raises(MXFP8PluginError, match="NOT CHECKED.*verify_accept_unchecked"):
            rep.raise_if_bad()
        again = r["te"]["swizzled_again"]
        assert again.verdict == "not checked" and again.unchecked == rep.unchecked, again.message()
        assert again.mxfp8_unchecked == rep.mxfp8_unchecked and again.unchecked_types == rep.unchecked_types
        accepted = r["te"]["swizzled_accepted"]
        assert accepted.ok and "accepted" in accepted.message(), accepted.message()
        accepted.raise_if_bad()
        drift = r["te"]["swizzled_drift"]
        assert not drift.ok and drift.replica_mismatches == [name], drift.message()
    assert all(r[kind]["swizzled"] is False for r in runs for kind in ("values", "ocp"))
    assert all(r[kind]["swizzled_again"] is False for r in runs for kind in ("values", "ocp"))
    assert all(r[kind]["swizzled_accepted"] is False for r in runs for kind in ("values", "ocp"))
