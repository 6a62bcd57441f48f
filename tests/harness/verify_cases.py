"""The rank side of the weight verifier's and ``ensure_weights_current``'s tests on real
megatron-core over 2 gloo ranks (tests/ranks/test_weights.py, test_sampling.py, test_replica.py,
test_ensure.py).

Every case runs in one rank launch per session (the toy jobs are cheap, process start-up is not:
tests/ranks/conftest.py's ``verify_runs``) in Megatron-LM's loop order (:mod:`.verify_loop`): the
kit's :func:`~mbridge_mxfp8_plugin.testing.megatron_lm_loop.train_step` for ordinary steps, and for
the point right after a step's forward and backward (where the weights must equal the quantized main
params the optimizer has not yet stepped) the same order cut before ``optimizer.step()``. Each
defect case runs with one of the plugin's fixes left out and with it in: the verifier must fire
where the fix is missing and stay silent where it is present. Expectations come from
docs/upstream.md's description of each release (0.16.1: no forced write-back, naive
``param_to_index``, dispatch state kept after a forced sync; write-back from 0.18, dispatch reset
from 0.19), gated on what :func:`~mbridge_mxfp8_plugin.probe_core` finds in the installed cell, not
on the verifier. The ``opt:`` cases run the product path: the loop API with
``PluginOptions(verify_weights=True)``, where a fix is switched off by disabling the plugin or one
engine step, and a save + resume through an in-memory checkpoint (``param.data`` as the save's
forced sync leaves it, and the fp32 main shards). The cases on params holding codes and scales
(whatever the pass's kind) and the one where only a peer's shard check can see the difference:
:mod:`.verify_codes`.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing import launch

from .verify_codes import case_codes, case_peer, case_rotation
from .verify_loop import (
    ITERS,
    ErrorLines,
    counting_gathers,
    forced_sync,
    forward_backward,
    load_snapshot,
    one_batch,
    snapshot_of,
    train,
)

__all__ = ["run_verify_cases", "verify_rank"]


def _stale_and_ensure(out: dict[str, Any]) -> None:
    from mbridge_mxfp8_plugin import ensure_weights_current, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig())
    out["init"] = verify_weights(job.model, job.optimizer, event="init")
    train(job, ITERS)  # no plugin
    out["stale"] = verify_weights(job.model, job.optimizer, event="after optimizer step")
    for key in ("ensure1", "ensure2"):
        gathers = [0]
        with counting_gathers(gathers):
            stats = ensure_weights_current(job.model, job.optimizer)
        out[key] = (stats, gathers[0], verify_weights(job.model, job.optimizer, event=key))
    # A later step that no adapter announced: the engine's "fresh" flag is now wrong.
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step

    train_step(job, *one_batch(job, 50))
    out["stale_again"] = verify_weights(job.model, job.optimizer, event="after a later step")
    gathers = [0]
    with counting_gathers(gathers):
        stats = ensure_weights_current(job.model, job.optimizer)
    out["ensure3"] = (stats, gathers[0], verify_weights(job.model, job.optimizer, event="ensure3"))
    # An adapter's refresh after this function's own: the engine's eval refresh made them
    # current, so a call before the next step gathers nothing (its docstring's promise).
    from mbridge_mxfp8_plugin import mxfp8_param_sync

    sync = mxfp8_param_sync(job.model, job.optimizer)
    sync.step_started()
    train_step(job, *one_batch(job, 51))
    gathers = [0]
    with counting_gathers(gathers):
        sync.before_eval()
    out["eval_gathers"] = gathers[0]
    gathers = [0]
    with counting_gathers(gathers):
        stats = ensure_weights_current(job.model, job.optimizer)
    out["ensure4"] = (stats, gathers[0], verify_weights(job.model, job.optimizer, event="ensure4"))
    sync.after_eval()
    sync.close()
    # One rank's copy of a bias drifts: the shard check cannot see it where this rank holds no
    # shard of it, the replica check must.
    name, param = next((n, p) for n, p in job.model[0].named_parameters() if n.endswith("bias"))
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            param.data.add_(1.0)
    out["replica_param"] = name
    out["replica"] = verify_weights(job.model, job.optimizer, event="perturbed")


def _case_b(mode: str) -> dict[str, Any]:
    """A forced sync (eval) after training: ``off`` no plugin; ``b1_off`` main params staged
    before it but nothing written back (core 0.16.1 writes forced gathers back never); ``b2_off``
    the gathered buffer written back without staging (it holds reduced gradients); ``on`` the API."""
    from mbridge_mxfp8_plugin import mxfp8_param_sync, verify_weights
    from mbridge_mxfp8_plugin.engine.sync import ParamSyncEngine
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig())
    sync = mxfp8_param_sync(job.model, job.optimizer) if mode == "on" else None
    engine = ParamSyncEngine.shared(job.model, job.optimizer)
    engine.prepare()  # offsets repaired in every mode: A is not what these cases look at
    train(job, ITERS, sync)
    if mode == "b1_off":
        engine.before_forced_sync()
    forced_sync(job)
    if mode == "b2_off":
        engine.before_eval(gathered_fresh=True)
    if sync is not None:
        sync.before_eval()
    rec: dict[str, Any] = {"eval": verify_weights(job.model, job.optimizer, event="eval")}
    for chunk in job.model:
        chunk.enable_forward_pre_hook()
    if sync is not None:
        sync.after_eval()
        sync.step_started()
    train_step(job, *one_batch(job, 60))
    forced_sync(job)  # the closing forced sync of train()
    if sync is not None:
        sync.close()
    rec["train_end"] = verify_weights(job.model, job.optimizer, event="train end")
    rec["job"] = job  # kept alive until every case ran: engines are keyed by the chunks' ids
    return rec


def _case_a(mode: str) -> dict[str, Any]:
    """Training forwards whose copy-back reads ``param_to_index``: unrepaired (off) / the API (on)."""
    from mbridge_mxfp8_plugin import check_bucket_alignment, mxfp8_param_sync, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig())
    misindexed = {m.param for m in check_bucket_alignment(job.model, repair=False).mismatches}
    sync = mxfp8_param_sync(job.model, job.optimizer) if mode == "on" else None
    train(job, ITERS, sync)
    if sync is not None:
        sync.step_started()
    forward_backward(job, 70)
    report = verify_weights(job.model, job.optimizer, event="after forward")
    return {"report": report, "misindexed": misindexed, "job": job}


def _case_c(mode: str) -> dict[str, Any]:
    """The step after a forced sync. Offsets repaired and no write-back in every mode (B1 left
    in); ``c_off``: nothing else, ``c_fixed``: only the engine's dispatch reset after the sync,
    ``on``: the API."""
    from mbridge_mxfp8_plugin import mxfp8_param_sync, verify_weights
    from mbridge_mxfp8_plugin.engine.sync import ParamSyncEngine
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig())
    sync = mxfp8_param_sync(job.model, job.optimizer) if mode == "on" else None
    engine = ParamSyncEngine.shared(job.model, job.optimizer)
    engine.prepare()
    train(job, ITERS, sync)
    forced_sync(job)
    if sync is not None:
        sync.before_eval()
    for chunk in job.model:
        chunk.enable_forward_pre_hook()
    if mode == "c_fixed":
        engine.after_forced_sync(restage=False)
    if sync is not None:
        sync.after_eval()
        sync.step_started()
    forward_backward(job, 80)
    report = verify_weights(job.model, job.optimizer, event="step after forced sync")
    return {"report": report, "job": job}


def _case_expert() -> dict[str, Any]:
    """Expert-parallel params (their own buffers and data-parallel group), plugin on via the API."""
    from mbridge_mxfp8_plugin import mxfp8_param_sync, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig(expert_layers=(1,)))
    sync = mxfp8_param_sync(job.model, job.optimizer)
    train(job, ITERS, sync)
    stale = verify_weights(job.model, job.optimizer, event="after optimizer step")
    forced_sync(job)
    sync.before_eval()
    report = verify_weights(job.model, job.optimizer, event="eval")
    experts = sum(len(b.params) for b in job.model[0].expert_parallel_buffers)
    return {"stale": stale, "report": report, "expert_params": experts, "job": job}


def _case_sampling() -> dict[str, Any]:
    """The sampled check on current weights: silent; then one owned slice shifted by 64 elements
    (A's signature), then one 32-element block negated in two params (one with a row length
    that is a multiple of 32, one whose rows end in a short block)."""
    from mbridge_mxfp8_plugin import ensure_weights_current, verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    job = build_job(ToyConfig(dims=(32, 45, 96, 45, 10)))
    train(job, ITERS)
    ensure_weights_current(job.model, job.optimizer)
    rec: dict[str, Any] = {"stride": round(1 / DEFAULT_VERIFY_SAMPLE)}
    rec["clean"] = verify_weights(job.model, job.optimizer, event="clean")
    rec["clean_full"] = verify_weights(job.model, job.optimizer, event="clean", sample=1.0)
    owned, _ = _owned_shards(job.optimizer)
    rec["owned_elements"] = sum(o.end - o.start for o in owned.values())
    names = {p: n for n, p in job.model[0].named_parameters()}
    # Weights (dim 2) only: the emulated MXFP8 params, read through their storage.
    mine = {
        names[p]: (p, o) for p, o in owned.items() if p.dim() == 2 and o.end - o.start >= 3 * p.shape[-1] + 32
    }
    by_last = sorted(mine, key=lambda n: mine[n][0].shape[-1] % 32 != 0)
    aligned, odd = by_last[0], by_last[-1]
    rec["aligned"], rec["odd"] = aligned, odd
    assert mine[aligned][0].shape[-1] % 32 == 0 and mine[odd][0].shape[-1] % 32 != 0

    def storage(param: Any) -> torch.Tensor:
        """Where the param keeps its elements: TE-shaped codes, or the values."""
        codes = getattr(param, "_rowwise_data", None)
        if codes is not None:
            return codes.view(-1)
        with torch._C.DisableTorchFunctionSubclass():
            return param.data.view(-1)

    def negate(block: torch.Tensor) -> None:
        block.bitwise_xor_(0x80) if block.dtype == torch.uint8 else block.neg_()  # E4M3 sign bit

    param, own = mine[aligned]
    flat = storage(param)
    saved = flat[own.start : own.end].clone()
    with torch.no_grad():
        flat[own.start : own.end] = torch.roll(saved, 64)
    rec["shifted"] = verify_weights(job.model, job.optimizer, event="shifted")
    with torch.no_grad():
        flat[own.start : own.end] = saved
    rec["restored"] = verify_weights(job.model, job.optimizer, event="restored", sample=1.0)
    # One block of each: the first whole 32-element block of a row inside the owned slice.
    for name in (aligned, odd):
        param, own = mine[name]
        last = param.shape[-1]
        row = -(-own.start // last) + 1
        start = row * last
        assert own.start <= start and start + 32 <= own.end
        with torch.no_grad():
            negate(storage(param)[start : start + 32])
    rec["one_block_full"] = verify_weights(job.model, job.optimizer, event="one block", sample=1.0)
    # The same check with the fused kernel off (its use is decided per layout: plans dropped).
    from mbridge_mxfp8_plugin.verify import weights

    # A budget of one 32-block write: a fused batch flagged differing is judged again by the
    # type's write in parts of that size (and the unfused check batches that small).
    budget = weights._BUDGET_BYTES
    weights._BUDGET_BYTES = 1
    weights._PLANS.clear()
    try:
        rec["one_block_full_small"] = verify_weights(job.model, job.optimizer, event="one block", sample=1.0)
    finally:
        weights._BUDGET_BYTES = budget
        weights._PLANS.clear()
    before = os.environ.get("MXFP8_VERIFY_FUSED")
    os.environ["MXFP8_VERIFY_FUSED"] = "0"
    weights._PLANS.clear()
    try:
        rec["one_block_full_unfused"] = verify_weights(
            job.model, job.optimizer, event="one block", sample=1.0
        )
    finally:
        os.environ.pop("MXFP8_VERIFY_FUSED")
        if before is not None:
            os.environ["MXFP8_VERIFY_FUSED"] = before
        weights._PLANS.clear()
    rec["one_block_sampled"] = [
        verify_weights(job.model, job.optimizer, event="one block") for _ in range(rec["stride"])
    ]
    return {**rec, "job": job}


def _case_plans() -> dict[str, Any]:
    """A check's plan is made once per layout and then reused, at every sampled phase of the
    default rotation (issue 32.1: the phase is data); a reused plan reads the current bits (a
    block corrupted after it was made is caught), and a main shard moved to new storage makes a
    new plan that reads there (a value changed there is caught)."""
    from mbridge_mxfp8_plugin import ensure_weights_current, verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job
    from mbridge_mxfp8_plugin.verify import weights
    from mbridge_mxfp8_plugin.verify.weights import _owned_shards

    job = build_job(ToyConfig(dims=(32, 64, 96, 10)))
    train(job, ITERS)
    ensure_weights_current(job.model, job.optimizer)
    made: list[int] = []
    real = weights._make_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    weights._make_plan = counted
    rec: dict[str, Any] = {}
    try:
        full = [verify_weights(job.model, job.optimizer, event="full", sample=1.0) for _ in range(2)]
        rec["full_made"], rec["full_ok"] = len(made), [r.ok for r in full]
        stride = round(1 / DEFAULT_VERIFY_SAMPLE)
        sampled = [verify_weights(job.model, job.optimizer, event="s") for _ in range(2 * stride)]
        rec["sampled_made"], rec["sampled_ok"] = len(made) - rec["full_made"], [r.ok for r in sampled]
        rec["stride"] = stride
        # Every rank flips one block of its first owned 2-D slice, after the plans were made.
        owned, _ = _owned_shards(job.optimizer)
        param, own = next((p, o) for p, o in owned.items() if p.dim() == 2 and o.end - o.start >= 64)
        codes = getattr(param, "_rowwise_data", None)  # TE-shaped: the codes; else the values
        with torch._C.DisableTorchFunctionSubclass():
            flat = codes.view(-1) if codes is not None else param.data.view(-1)
        block = flat[own.start : own.start + 32]

        def negate() -> None:  # the E4M3 sign bit, or the value's sign
            block.bitwise_xor_(0x80) if block.dtype == torch.uint8 else block.neg_()

        before = len(made)
        with torch.no_grad():
            negate()
        rec["corrupt"] = verify_weights(job.model, job.optimizer, event="corrupt", sample=1.0)
        with torch.no_grad():
            negate()
        rec["restored"] = verify_weights(job.model, job.optimizer, event="restored", sample=1.0)
        rec["made_while_corrupt"] = len(made) - before
        # The optimizer's main shard moves to new storage: a new plan, which reads the new one.
        with torch.no_grad():
            own.main.data = own.main.data.clone()
        rec["moved"] = verify_weights(job.model, job.optimizer, event="moved", sample=1.0)
        rec["made_after_move"] = len(made) - before
        with torch.no_grad():
            own.main.data[:32].add_(1.0)
        rec["moved_changed"] = verify_weights(job.model, job.optimizer, event="moved", sample=1.0)
    finally:
        weights._make_plan = real
    return rec


class _StandInGraph:
    """A captured graph on CPU: its replay runs what was recorded again into the recorded
    outputs, and logs that it ran (where a CUDA graph's replay launches the recorded kernels)."""

    def __init__(self, record: Any, out: torch.Tensor, log: list[str]) -> None:
        from mbridge_mxfp8_plugin.verify.shard import ShardCheck

        self.record, self.out, self.log = record, out, log
        cells = [c.cell_contents for c in record.__closure__ or ()]
        self.check = next(c for c in cells if isinstance(c, ShardCheck))  # what it records into

    #: Whether a replay runs the recording again (off: its outputs keep the last run's, as a GPU
    #: replay whose inputs did not change; no Python runs, as none runs in a GPU replay)
    rerun = True

    def replay(self) -> None:
        self.log.append("replay")
        if self.rerun:
            self.check.verdicts = []  # the recording appends to them; a replay only writes ``out``
            self.out.copy_(self.record())


def _case_early_replay() -> dict[str, Any]:
    """A kept plan's graph is launched before the layout is checked (the two overlap) and is read
    only where the layout holds (the same objects at the same addresses, else an equal new
    fingerprint); a tensor re-pointed or freed in place is caught by its address before any
    launch. Graphs stand in on CPU
    (:class:`_StandInGraph`); per call, the order of the replays, the chunks' discovery, the
    identity checks and the fingerprints is logged."""
    from mbridge_mxfp8_plugin import ensure_weights_current, verify_weights
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job
    from mbridge_mxfp8_plugin.verify import graphs, weights

    job = build_job(ToyConfig(dims=(32, 64, 96, 10)))
    train(job, ITERS)
    ensure_weights_current(job.model, job.optimizer)
    log: list[str] = []
    saved = (
        graphs.on_cuda,
        graphs.capture,
        weights.fingerprint,
        torch.cuda.is_current_stream_capturing,
        weights.unchanged,
        weights._model_chunks,
    )

    def capture(record: Any, paths: Any = ()) -> tuple[Any, Any]:
        out = record()
        return _StandInGraph(record, out, log), out

    collector: list[bool] = []

    def fingerprint(*args: Any) -> Any:
        log.append("fingerprint")
        collector.append(gc.isenabled())
        return saved[2](*args)

    def unchanged(*args: Any) -> Any:
        log.append("unchanged")
        collector.append(gc.isenabled())
        return saved[4](*args)

    graphs.on_cuda, graphs.capture, weights.fingerprint = (lambda t: True), capture, fingerprint

    def chunks(*args: Any) -> Any:
        log.append("chunks")
        return saved[5](*args)

    weights.unchanged, weights._model_chunks = unchanged, chunks
    torch.cuda.is_current_stream_capturing = lambda: False
    weights._PLANS.clear()
    rec: dict[str, Any] = {}

    def check(label: str) -> None:
        del log[:]
        rec[label] = verify_weights(job.model, job.optimizer, event=label, sample=1.0)
        rec[f"{label}_log"] = list(log)

    try:
        check("first")  # planned, run eagerly, recorded and launched once
        check("second")
        # A replayed call leaves nothing to the cyclic collector. The replay runs no Python here
        # (the CPU kernels' interpreter makes cycles of its own, which a GPU replay does not run).
        # Only what this check makes is counted: the heap as it stands is frozen first, since an
        # earlier case's job (TE-shaped params are cyclic, as in TE) can turn to garbage meanwhile
        # and would be counted against the check (33 objects in the TE-shaped pass)
        gc.collect()
        gc.freeze()
        _StandInGraph.rerun = False
        try:
            check("steady")
            rec["left_for_the_collector"] = gc.collect()
        finally:
            _StandInGraph.rerun = True
            gc.unfreeze()
        owned, _ = weights._owned_shards(job.optimizer)
        param, own = next((p, o) for p, o in owned.items() if p.dim() == 2 and o.end - o.start >= 64)
        groups = next(o for o in _distributed(job.optimizer)).shard_fp32_from_float16_groups
        g, i = next((g, i) for g, ms in enumerate(groups) for i, m in enumerate(ms) if m is own.main)
        with torch.no_grad():
            moved = own.main.clone()
            moved[:32].add_(1.0)
        groups[g][i] = moved  # a new object: the old one, which the plan holds, keeps its address
        check("replaced")
        with torch.no_grad():
            moved.data = moved.data.clone()  # the same object, re-pointed: another address
        check("moved")
    finally:
        graphs.on_cuda, graphs.capture, weights.fingerprint = saved[:3]
        torch.cuda.is_current_stream_capturing, weights.unchanged, weights._model_chunks = saved[3:]
        weights._PLANS.clear()
    rec["param"] = next(n for n, p in job.model[0].named_parameters() if p is param)
    rec["collector"] = (collector, gc.isenabled())  # during each check, after the last
    return rec


def _distributed(optimizer: Any) -> Any:
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    return iter(distributed_optimizers(optimizer))


def _case_option(mode: str) -> dict[str, Any]:
    """The loop API with ``verify_weights=True`` in Megatron-LM's order: steps, an eval, a step, a
    save, train end. ``disabled``: ``enabled=False`` (every fix off; ``strict`` so it raises);
    ``b1_off``/``b2_off``: the plugin on with its write-back skipped / the loop's unstaged forced
    gather trusted (``strict=False``: ERROR records); ``on``: the plugin on, then a resume from
    the checkpoint the save produced; ``stale_ckpt``: ``enabled=False`` through the save, then the
    same resume, where the check at load must find the checkpoint's weights stale."""
    from mbridge_mxfp8_plugin import MXFP8PluginError, PluginOptions, mxfp8_param_sync
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    off = mode in ("disabled", "stale_ckpt")
    options = PluginOptions(enabled=not off, verify_weights=True, strict=mode in ("disabled", "on"))
    job = build_job(ToyConfig())
    sync = mxfp8_param_sync(job.model, job.optimizer, options)
    if mode == "b1_off":
        sync.engine._writes().run = lambda *, zero: 0  # type: ignore[union-attr]
    if mode == "b2_off":
        sync.engine._judge_fresh = lambda gathered_fresh: True  # type: ignore[union-attr]
    rec: dict[str, Any] = {"reports": {}, "error": None}
    with ErrorLines() as errors:
        try:
            train(job, ITERS, sync)
            forced_sync(job)
            sync.before_eval()
            rec["reports"]["eval"] = sync.last_report
            for chunk in job.model:
                chunk.enable_forward_pre_hook()
            sync.after_eval()
            sync.step_started()
            train_step(job, *one_batch(job, 90))
            sync.last_report = None
            sync.before_save()
            rec["reports"]["save"] = sync.last_report
            forced_sync(job)  # the save's forced sync, then what it writes
            snapshot = snapshot_of(job)
            sync.close()
            rec["reports"]["train_end"] = sync.last_report
        except MXFP8PluginError as exc:
            rec["error"] = str(exc)
        if mode in ("on", "stale_ckpt") and rec["error"] is None:
            job2 = build_job(ToyConfig())
            load_snapshot(job2, snapshot)
            resumed = mxfp8_param_sync(job2.model, job2.optimizer, options)
            rec["reports"]["load"] = resumed.verify("checkpoint load")
            if mode == "on":
                train(job2, 1, resumed)
                forced_sync(job2)
                resumed.before_eval()
                rec["reports"]["resumed eval"] = resumed.last_report
                rec["job2"] = job2
    rec["errors"] = list(errors)
    rec["job"] = job
    return rec


def verify_rank() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    out: dict[str, Any] = {}
    with cpu_shim(), emulated_mxfp8():
        _stale_and_ensure(out)
        for mode in ("off", "b1_off", "b2_off", "on"):
            out[f"b:{mode}"] = _case_b(mode)
        for mode in ("off", "on"):
            out[f"a:{mode}"] = _case_a(mode)
        for mode in ("c_off", "c_fixed", "on"):
            out[f"c:{mode}"] = _case_c(mode)
        out["expert"] = _case_expert()
        out["sampling"] = _case_sampling()
        out["plans"] = _case_plans()
        out["early"] = _case_early_replay()
        out["codes"] = case_codes()  # the kit's TE-shaped type in every pass (harness.verify_codes)
        out["peer"] = case_peer()
        out["rotation"] = case_rotation()
        for mode in ("disabled", "b1_off", "b2_off", "on", "stale_ckpt"):
            out[f"opt:{mode}"] = _case_option(mode)
    for value in out.values():
        if isinstance(value, dict):
            value.pop("job", None)
            value.pop("job2", None)
    from mbridge_mxfp8_plugin import probe_core

    out["core"] = __import__("megatron.core", fromlist=["__version__"]).__version__
    out["behaviour"] = probe_core().as_dict()
    return out


def run_verify_cases(world_size: int = 2) -> list[dict[str, Any]]:
    """Every case above in one launch: per rank, each case's record, the installed core's version
    and what :func:`~mbridge_mxfp8_plugin.probe_core` finds it does by itself."""
    return launch(verify_rank, world_size)
