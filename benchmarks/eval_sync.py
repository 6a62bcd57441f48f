"""Cost of the plugin's around-eval param sync vs megatron-core 0.19's native path and the physical floor.

One command runs everything (on a 2-GPU host; see benchmarks/README.md):

    python benchmarks/eval_sync.py run --core 0.16.1=/tmp/core0161 --core 0.19.2=/tmp/core0192 \
        --out benchmarks/results

``run`` starts one ``torchrun --nproc_per_node=2`` worker per megatron-core install (each its own
PYTHONPATH), collects their JSON, computes the ratios and targets, and writes
``eval_sync.json`` and ``eval_sync.png``. Both workers run inside the same invocation on the same
machine, so ratios are measured side by side.

What a worker measures, per model size (emulated-MXFP8 weights, bf16 biases, DP=2):

* ``plugin_full``: the plugin gathers itself (``before_eval`` with no forced sync before it): stage
  main params, all-gather, write back, then ``after_forced_sync`` (the loop API's path);
* ``plugin_prestaged``: the Bridge adapter's path: ``before_forced_sync`` at ``on_train_step_end``,
  the framework's forced all-gather, ``before_eval``'s write-back (core < 0.18) and
  ``after_forced_sync``: one gather in total;
* ``native``: core 0.19's ``prepare_model_params_for_param_sync`` + forced sync with its own
  post-processing (only where core has it);
* each of the three again with a one-pass quantizer (``*_plainquant``): every MXFP8 write is one
  in-place bf16 copy, standing in for TE's fused cast kernel, so that the engines are compared
  rather than the emulation's ~ten fp32 passes;
* ``quantize``: the write-back of MXFP8 params alone (the emulation's cost, not TE's). The
  emulated quantizer is the test kit's ``mxfp8_quantize``: Transformer Engine's rowwise cast rule
  (round-up E8M0 scale of ``amax * fp32(1/448)``, E4M3 round-to-nearest-even), so the values
  written are TE's; the one-pass stand-in above writes the values unrounded and times only;
* the physical floor: bytes the necessary copies move (stage the fp32 shard into bf16, read the
  gathered bf16 and write the param) over the measured device-to-device bandwidth, plus a raw
  NCCL all-gather of the same size. Re-zeroing the buffer is not necessary when a training step
  follows (its ``zero_grad_buffer`` does it) and is not in the floor;
* all-gathers issued per eval, extra peak memory, host time per parameter on a model with ~10k
  small params, and the hooks' cost on training steps without a forced sync;
* ``verify``: the weight verifier (``verify_weights``, what ``PluginOptions(verify_weights=True)``
  runs after every forced sync) right after an eval transition, with each quantizer: time per
  call, extra peak memory, memory left allocated afterwards (must be 0), whether it found the
  weights right (it must), and its ratio to the eval transition it follows, at the default block
  sample (``verify_*``; target <= 0.25 at 4B with the one-pass quantizer, which stands in for TE's
  fused cast on both sides) and at ``sample=1.0`` (``verify_full_*``, every block; reported only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SIZES = {"125M": (1024, 120), "1B": (4096, 60), "4B": (8192, 60)}  # hidden, layers of [h, h]
DEFAULT_SIZES = "1B,4B"
REPS = 5


# ----------------------------------------------------------------------------------- worker
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    torch.distributed.barrier()


def _timed(fn: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _timeit(fn: Any, setup: Any = None, reps: int = REPS) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up; ``setup`` runs untimed."""
    times = []
    for i in range(reps + 1):
        if setup:
            setup()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _GatherCounter:
    """Counts all-gathers megatron-core issues (its buffer module binds the function at import)."""

    def __init__(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        self.pgb, self.orig, self.count = pgb, pgb.dist_all_gather_func, 0

        def counted(*a: Any, **k: Any) -> Any:
            self.count += 1
            return self.orig(*a, **k)

        pgb.dist_all_gather_func = counted

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def _peak_extra(fn: Any) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()  # not _sync(): a barrier allocates its own small tensor
    return int(torch.cuda.max_memory_allocated() - base)


def _plain_quantizer() -> Any:
    """Swap the emulated quantizer for one in-place cast: what TE's fused kernel costs in launches
    and memory (no temporaries), so engine overheads are measured without the emulation's. It does
    not round onto the MXFP8 grid: timings only, never values."""
    import contextlib

    import torch

    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    @contextlib.contextmanager
    def ctx() -> Any:
        orig = EmulatedMXFP8Tensor.quantize_

        def direct(self: Any, values: torch.Tensor) -> None:
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.copy_(self, values.reshape(self.shape))

        EmulatedMXFP8Tensor.quantize_ = direct  # type: ignore[method-assign]
        try:
            yield
        finally:
            EmulatedMXFP8Tensor.quantize_ = orig  # type: ignore[method-assign]

    return ctx()


def _train_one_step(job: Any) -> None:
    """One step in megatron-core's loop order (Megatron-LM core_v0.16.1 training.py L1614-1647)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mbridge_mxfp8_plugin.testing.toy import make_batches

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    if len(job.model[0].remove_forward_pre_hook_handles) > 0:  # stage only with pre-hooks on
        for opt in job.optimizer.chained_optimizers:
            if isinstance(opt, DistributedOptimizer):
                opt._copy_main_params_to_param_buffer()
    ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=0)
    job.model[0](x, y).backward()
    for chunk in job.model:
        chunk.finish_grad_sync()
    job.optimizer.step()


def _measure_size(label: str, hidden: int, layers: int) -> dict[str, Any]:
    import torch

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback, ParamSyncEngine
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    toy = ToyConfig(dims=(hidden,) * (layers + 1), micro_batch_size=4)
    job = build_job(toy)
    # Steady state: pre-hooks on, one real step behind us (the buffer holds reduced gradients).
    _train_one_step(job)
    engine = ParamSyncEngine(job.model, job.optimizer)
    engine.prepare()
    counter = _GatherCounter()
    n_params = sum(p.numel() for p in job.model[0].parameters())
    n_groups = len(engine.bucket_groups())
    res: dict[str, Any] = {"size": label, "params": n_params, "bucket_groups": n_groups}

    def reset() -> None:
        # Stands in for a training step between two evals: the weights are no longer fresh and
        # no group is left dispatched.
        engine.step_started()
        for g in engine.bucket_groups():
            g.param_gather_dispatched = False

    def plugin_full() -> None:
        engine.before_eval(gathered_fresh=False)
        engine.after_forced_sync()

    def framework_forced_sync() -> None:
        for chunk in job.model:
            chunk.start_param_sync(force_sync=True)

    def plugin_prestaged() -> None:
        engine.before_forced_sync()
        framework_forced_sync()
        engine.before_eval()
        engine.after_forced_sync()

    res["plugin_full_s"] = _timeit(plugin_full, reset)
    counter.take()
    reset()
    plugin_full()
    res["plugin_full_allgathers"] = counter.take()
    res["plugin_prestaged_s"] = _timeit(plugin_prestaged, reset)
    counter.take()
    reset()
    plugin_prestaged()
    res["plugin_prestaged_allgathers"] = counter.take()
    # The plugin's own share of the prestaged path (the forced gather is the framework's).
    res["framework_forced_sync_s"] = _timeit(framework_forced_sync, reset)

    # Write-back of MXFP8 params alone = the emulated quantization's cost.
    mx = [p for p in job.model[0].parameters() if type(p).__name__ == "EmulatedMXFP8Tensor"]
    srcs = [torch.empty_like(p.detach(), dtype=torch.bfloat16) for p in mx[:1]]

    def quantize_all() -> None:
        for p in mx:
            p.data.copy_(srcs[0] if srcs[0].shape == p.shape else p.detach())

    res["quantize_s"] = _timeit(quantize_all)
    reset()
    res["plugin_peak_extra_bytes_emulated"] = _peak_extra(plugin_full)
    with _plain_quantizer():
        reset()
        res["plugin_peak_extra_bytes_engine"] = _peak_extra(plugin_full)
        res["plugin_full_plainquant_s"] = _timeit(plugin_full, reset)
        res["plugin_prestaged_plainquant_s"] = _timeit(plugin_prestaged, reset)

    res.update(_measure_verify(job, reset, plugin_full))

    core = ParamSyncEngine(job.model, job.optimizer).behaviour
    if core.has_prepare_for_param_sync:
        opt = job.optimizer

        def native() -> None:
            if hasattr(opt, "prepare_model_params_for_param_sync"):
                opt.prepare_model_params_for_param_sync()
            else:
                for o in distributed_optimizers(opt):
                    o.prepare_model_params_for_param_sync()
            framework_forced_sync()

        res["native_s"] = _timeit(native, reset)
        with _plain_quantizer():
            res["native_plainquant_s"] = _timeit(native, reset)
        counter.take()
        reset()
        native()
        res["native_allgathers"] = counter.take()
        reset()
        res["native_peak_extra_bytes_emulated"] = _peak_extra(native)

    # Physical floor, measured in this process: copy bandwidth and a raw all-gather of the size.
    elems = sum(b.param_data.numel() for g in engine.bucket_groups() for b in g.buckets)
    dev = job.model[0].module.layers[0].bias.device
    big = torch.empty(max(elems, 1 << 26), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(big)
    t_copy = _timeit(lambda: dst.copy_(big))
    bw = 2 * big.numel() * big.element_size() / t_copy  # bytes read + written per second
    world = torch.distributed.get_world_size()
    shard = big[: elems // world]
    out = big.new_empty(shard.numel() * world)
    res["raw_allgather_s"] = _timeit(lambda: torch.distributed.all_gather_into_tensor(out, shard))
    n = n_params
    # stage: read fp32 shard + write bf16 shard; write-back: read bf16 + write the param
    # (emulation stores bf16). No re-zeroing: the next step's zero_grad_buffer does it.
    res["floor_copy_bytes"] = int((4 + 2) * n / world + (2 + 2) * n)
    res["copy_bandwidth_Bps"] = bw
    res["floor_s"] = res["floor_copy_bytes"] / bw + res["raw_allgather_s"]
    counter.pgb.dist_all_gather_func = counter.orig

    # Hooks on a training step with no forced sync ahead: what the callback costs per step.
    # validate=False: the config check runs once at train start and needs the config readers,
    # which the GPU host need not have; the per-step cost measured here does not include it.
    cb = MXFP8ParamSyncCallback(validate=False)
    from types import SimpleNamespace

    state = SimpleNamespace(
        cfg=SimpleNamespace(
            train=SimpleNamespace(eval_interval=1000, train_iters=10**6, exit_interval=None),
            checkpoint=SimpleNamespace(save=None, save_interval=None),
        ),
        train_state=SimpleNamespace(step=1, do_valid=True),
    )
    ctx = SimpleNamespace(model=job.model, optimizer=job.optimizer, state=state)
    cb.on_train_start(ctx)
    counter = _GatherCounter()
    t0 = time.perf_counter()
    for _ in range(1000):
        cb.on_train_step_start(ctx)
        cb.on_train_step_end(ctx)
    res["hooks_per_plain_step_s"] = (time.perf_counter() - t0) / 1000
    res["hooks_plain_step_allgathers"] = counter.take()
    counter.pgb.dist_all_gather_func = counter.orig
    return res


def _measure_verify(job: Any, reset: Any, transition: Any) -> dict[str, Any]:
    """The verifier after an eval transition, with the emulated (TE-rule) and the one-pass
    quantizer, at the default block sample (``verify_*``, what the option runs) and at 1.0
    (``verify_full_*``, every block): each run checks weights that the same quantizer wrote, so
    it must find them right."""
    import torch

    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE

    res: dict[str, Any] = {"verify_sample": DEFAULT_VERIFY_SAMPLE}
    for suffix, quant in (("", None), ("_plainquant", _plain_quantizer)):
        with quant() if quant else _nothing():
            reset()
            transition()  # the weights are current: what the option checks after an eval
            for kind, sample in (("verify", DEFAULT_VERIFY_SAMPLE), ("verify_full", 1.0)):

                def check(sample: float = sample) -> Any:
                    return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

                report = check()
                res[f"{kind}{suffix}_ok"] = report.ok
                res[f"{kind}{suffix}_params_checked"] = report.params_checked
                res[f"{kind}{suffix}_elements_checked"] = report.elements_checked
                res[f"{kind}{suffix}_s"] = _timeit(check)
                before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                res[f"{kind}{suffix}_peak_extra_bytes"] = _peak_extra(check)
                after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                res[f"{kind}{suffix}_persistent_bytes"] = int(after - before)
    return res


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _host_time_per_param() -> dict[str, Any]:
    """~10k small params: host-side cost per param of a refresh (one write kernel per param)."""
    from mbridge_mxfp8_plugin import ParamSyncEngine
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    job = build_job(ToyConfig(dims=(64,) * 5001, micro_batch_size=2))
    _train_one_step(job)
    engine = ParamSyncEngine(job.model, job.optimizer)
    engine.prepare()
    n = sum(1 for _ in job.model[0].parameters())

    def reset() -> None:
        engine.step_started()
        for g in engine.bucket_groups():
            g.param_gather_dispatched = False

    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    with _plain_quantizer():
        t_refresh = _timeit(
            lambda: (engine.before_eval(gathered_fresh=False), engine.after_forced_sync()), reset
        )
        t_written = _timeit(lambda: engine._writes().run(zero=False))
    # The engine's own host cost: the write-back loop with the quantizer doing nothing at all.
    orig = EmulatedMXFP8Tensor.quantize_
    EmulatedMXFP8Tensor.quantize_ = lambda self, values: None  # type: ignore[method-assign,assignment]
    try:
        t_engine = _timeit(lambda: engine._writes().run(zero=False))
    finally:
        EmulatedMXFP8Tensor.quantize_ = orig  # type: ignore[method-assign]
    t_stage = _timeit(engine.stage_main_params)
    t_restore = _timeit(engine.step_started, reps=20)
    return {
        "params": n,
        "refresh_per_param_s": t_refresh / n,
        "write_back_per_param_s": t_written / n,
        "engine_loop_per_param_s": t_engine / n,
        "core_staging_per_param_s": t_stage / n,
        "restore_per_param_s": t_restore / n,
    }


def worker(args: argparse.Namespace) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    import megatron.core

    out: dict[str, Any] = {"core": megatron.core.__version__, "sizes": [], "torch": torch.__version__}
    with cpu_shim(), emulated_mxfp8():
        for label in args.sizes.split(","):
            hidden, layers = SIZES[label] if label in SIZES else tuple(int(v) for v in label.split("x"))
            out["sizes"].append(_measure_size(label, hidden, layers))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the size's job is gone with _measure_size's frame
            if torch.distributed.get_rank() == 0:
                print(json.dumps(out["sizes"][-1]), flush=True)
        if args.host_params:
            out["host"] = _host_time_per_param()
    if torch.distributed.get_rank() == 0:
        Path(args.json).write_text(json.dumps(out, indent=2))
    torch.distributed.destroy_process_group()


# ------------------------------------------------------- the verifier on the TE-shaped type
#: Issue 23's targets for the verifier on the TE-shaped type at 4B, with the one-pass cast.
VERIFY_TARGETS = {"sampled_vs_eval": 0.25, "full_vs_eval": 1.0, "sampled_peak_bytes": 64 << 20}


def _graph_pool_bytes(module: Any) -> int:
    """Device memory the kept plans' CUDA graphs hold (their shared pool): reserved bytes with
    the plans, less without them, each after emptying the allocator's cache. Drops the plans."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with_plans = torch.cuda.memory_reserved()
    module._PLANS.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return int(with_plans - torch.cuda.memory_reserved())


def _one_pass_te() -> Any:
    """Swap the TE-shaped quantizer's cast for one pass per direction: codes = the source cast to
    E4M3 directly, every scale byte 127 (unit scale). Stands in for TE's fused kernel (one read
    of the source, one write of codes and scales) so the transition and the verifier's reference
    cost what they would with TE; not TE's values, but the param and the reference agree."""
    import contextlib

    import torch

    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer

    @contextlib.contextmanager
    def ctx() -> Any:
        orig = TEShapedMXFP8Quantizer.update_quantized

        def one_pass(self: Any, src: torch.Tensor, dst: Any, *, noop_flag: Any = None) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                values = torch.Tensor.reshape(src, dst.shape)
                for used, data, scales in (
                    (self.rowwise_usage, dst._rowwise_data, dst._rowwise_scale_inv),
                    (self.columnwise_usage, dst._columnwise_data, dst._columnwise_scale_inv),
                ):
                    if used:
                        data.view(torch.float8_e4m3fn).copy_(values.clamp(-448, 448))
                        scales.fill_(127)
            dst._fp8_dtype = self.dtype
            return dst

        TEShapedMXFP8Quantizer.update_quantized = one_pass  # type: ignore[method-assign]
        try:
            yield
        finally:
            TEShapedMXFP8Quantizer.update_quantized = orig  # type: ignore[method-assign]

    return ctx()


def _verify_floor_bytes(job: Any) -> tuple[int, int]:
    """Bytes the full check must read (main shards and owned param bytes; every param's bytes
    when there is a replica to compare with), and the param bytes this rank holds."""
    from mbridge_mxfp8_plugin.verify.weights import _buffer_params, _owned_shards

    owned, _ = _owned_shards(job.optimizer)
    world = __import__("torch").distributed.get_world_size()
    held = 0
    need = 0
    for _, p in _buffer_params(list(job.model)):
        per = 1 + 1 / 32 if hasattr(p, "_rowwise_data") else p.element_size()  # codes + scales
        held += int(p.numel() * (2 if hasattr(p, "_columnwise_data") else 1) * per)
        o = owned.get(p)
        if o is not None:
            need += int((o.end - o.start) * (4 + per))
        if world > 1:
            need += int(p.numel() * per)
    return need, held


def _measure_verify_te(label: str, hidden: int, layers: int) -> dict[str, Any]:
    """Eval transition, sampled and full check, peak memory and the full check's floor, on the
    TE-shaped type, with the emulated (TE-rule) cast and with the one-pass cast."""
    import torch

    from mbridge_mxfp8_plugin import ParamSyncEngine, verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job
    from mbridge_mxfp8_plugin.verify import weights as verify_weights_module

    job = build_job(ToyConfig(dims=(hidden,) * (layers + 1), micro_batch_size=4))
    _train_one_step(job)
    engine = ParamSyncEngine(job.model, job.optimizer)
    engine.prepare()
    world = torch.distributed.get_world_size()
    res: dict[str, Any] = {"size": label, "params": sum(p.numel() for p in job.model[0].parameters())}
    res["dp"], res["sample"] = world, DEFAULT_VERIFY_SAMPLE
    res["mxfp8_type"] = sorted({type(p).__name__ for p in job.model[0].parameters()})

    def reset() -> None:
        engine.step_started()
        for g in engine.bucket_groups():
            g.param_gather_dispatched = False

    def transition() -> None:  # the Bridge callback's eval path (see _measure_size)
        engine.before_forced_sync()
        for chunk in job.model:
            chunk.start_param_sync(force_sync=True)
        engine.before_eval()
        engine.after_forced_sync()

    for cast, quant in (("emulated", None), ("onepass", _one_pass_te)):
        with quant() if quant else _nothing():
            res[f"eval_{cast}_s"] = _timeit(transition, reset)
            reset()
            transition()  # the weights are current: what the option checks after an eval
            for kind, sample in (("sampled", DEFAULT_VERIFY_SAMPLE), ("full", 1.0)):

                def check(sample: float = sample) -> Any:
                    return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

                key = f"{kind}_{cast}"
                # The first call of a job (and of each sampled phase) makes the check's plan; the
                # second of a phase captures it as a CUDA graph; later calls replay it.
                verify_weights_module._PLANS.clear()
                _sync()
                t0 = time.perf_counter()
                report = check()
                _sync()
                res[f"{key}_first_s"] = time.perf_counter() - t0
                res[f"{key}_ok"] = report.ok and not report.unchecked
                res[f"{key}_unchecked"] = len(report.unchecked)
                res[f"{key}_paths"] = report.reference_paths
                res[f"{key}_fused"] = any("fused" in p for p in report.reference_paths)
                res[f"{key}_elements"] = report.elements_checked
                stride = round(1 / sample)
                first_round = [_timed(check) for _ in range(stride - 1)]  # the other phases' first calls
                second_round = [_timed(check) for _ in range(stride)]  # each phase's capture
                res[f"{key}_first_round_s"] = statistics.median([res[f"{key}_first_s"], *first_round])
                res[f"{key}_second_round_s"] = statistics.median(second_round)
                for _ in range(stride):
                    check()
                res[f"{key}_s"] = _timeit(check)  # steady state: every phase replayed
                res[f"{key}_ok_steady"] = check().ok
                plans = [
                    plan.check
                    for layout in list(verify_weights_module._PLANS.values())
                    for plan in layout.plans.values()
                ]
                res[f"{key}_graphs"] = sum(c.graph is not None for c in plans)
                res[f"{key}_no_graph"] = sorted({c.no_graph for c in plans if c.no_graph})
                res[f"{key}_graph_pool_bytes"] = _graph_pool_bytes(verify_weights_module)
                # The eager run of a fresh plan allocates what a replay reuses from its pool.
                before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                res[f"{key}_peak_extra_bytes"] = _peak_extra(check)
                after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                res[f"{key}_persistent_bytes"] = int(after - before)
    need, held = _verify_floor_bytes(job)
    dev = job.model[0].module.layers[0].bias.device
    big = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB: launch costs negligible
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * big.element_size() / _timeit(lambda: dst.copy_(big))  # read + write
    res.update(full_floor_bytes=need, param_bytes_held=held, copy_bandwidth_Bps=bw, full_floor_s=need / bw)
    return res


def verify_worker(args: argparse.Namespace) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ["MXFP8_PARAM_KIND"] = "te"
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    import megatron.core

    out: dict[str, Any] = {"core": megatron.core.__version__, "torch": torch.__version__, "sizes": []}
    with cpu_shim(), emulated_mxfp8():
        for label in args.sizes.split(","):
            hidden, layers = SIZES[label] if label in SIZES else tuple(int(v) for v in label.split("x"))
            out["sizes"].append(_measure_verify_te(label, hidden, layers))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if torch.distributed.get_rank() == 0:
                print(json.dumps(out["sizes"][-1]), flush=True)
    if torch.distributed.get_rank() == 0:
        Path(args.json).write_text(json.dumps(out, indent=2))
    torch.distributed.destroy_process_group()


def verify_rows(raw: dict[str, Any], core: str) -> list[dict[str, Any]]:
    """Ratios and checks per size, flat (one CSV row each)."""
    rows = []
    for size in raw["sizes"]:
        row = {"core": core, **{k: v for k, v in size.items() if not k.endswith("_paths")}}
        row["mxfp8_type"] = ",".join(size["mxfp8_type"])
        for cast in ("onepass", "emulated"):
            for kind in ("sampled", "full"):
                row[f"ratio_{kind}_vs_eval_{cast}"] = size[f"{kind}_{cast}_s"] / size[f"eval_{cast}_s"]
                for when in ("first", "first_round", "second_round"):
                    if f"{kind}_{cast}_{when}_s" in size:
                        ratio = size[f"{kind}_{cast}_{when}_s"] / size[f"eval_{cast}_s"]
                        row[f"ratio_{kind}_{when}_vs_eval_{cast}"] = ratio
        row["ratio_full_vs_floor"] = size["full_onepass_s"] / size["full_floor_s"]
        # TE's rule (the emulated cast's weights): the check takes the fused kernel where it may
        # (verify/fused.py), and then costs no cast at all: set against the one-pass transition.
        row["fused"] = bool(size.get("sampled_emulated_fused") and size.get("full_emulated_fused"))
        if row["fused"]:
            for kind in ("sampled", "full"):
                for when in ("", "_first", "_first_round"):
                    if f"{kind}_emulated{when}_s" in size:
                        ratio = size[f"{kind}_emulated{when}_s"] / size["eval_onepass_s"]
                        row[f"ratio_{kind}{when}_fused_vs_eval_onepass"] = ratio
            row["ratio_full_fused_vs_floor"] = size["full_emulated_s"] / size["full_floor_s"]
        budget = max(VERIFY_TARGETS["sampled_peak_bytes"], size["param_bytes_held"] // 100)
        row["peak_budget_bytes"] = budget
        row["pass_no_false_alarm"] = all(
            size[f"{k}_{c}_{ok}"]
            for k in ("sampled", "full")
            for c in ("onepass", "emulated")
            for ok in ("ok", "ok_steady")
            if f"{k}_{c}_{ok}" in size
        )
        row["pass_peak"] = all(
            size[f"{k}_{c}_peak_extra_bytes"] <= budget
            for k in ("sampled", "full")
            for c in ("onepass", "emulated")
        )
        row["pass_sampled_vs_eval"] = (
            row["ratio_sampled_vs_eval_onepass"] <= VERIFY_TARGETS["sampled_vs_eval"]
        )
        row["pass_full_vs_eval"] = row["ratio_full_vs_eval_onepass"] <= VERIFY_TARGETS["full_vs_eval"]
        if row["fused"]:
            sampled = row["ratio_sampled_fused_vs_eval_onepass"]
            full = row["ratio_full_fused_vs_eval_onepass"]
            row["pass_sampled_fused_vs_eval"] = sampled <= VERIFY_TARGETS["sampled_vs_eval"]
            row["pass_full_fused_vs_eval"] = full <= VERIFY_TARGETS["full_vs_eval"]
        rows.append(row)
    return rows


def verify_plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot at {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("eval transition, one-pass cast", "eval_onepass_s"),
        ("eval transition, emulated cast", "eval_emulated_s"),
        ("sampled check, TE's rule (fused kernel)", "sampled_emulated_s"),
        ("full check, TE's rule (fused kernel)", "full_emulated_s"),
        ("full check, another rule (type's own write)", "full_onepass_s"),
        ("full check's floor (bytes / HBM bw)", "full_floor_s"),
    ]
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{r['size']}\ncore {r['core']}" for r in rows]
    width = 0.13
    for i, (name, key) in enumerate(series):
        ax.bar(
            [x + (i - 2.5) * width for x in range(len(rows))], [r[key] * 1e3 for r in rows], width, label=name
        )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"verify_weights on the TE-shaped MXFP8 type, DP={rows[0]['dp'] if rows else '?'}")
    ax.legend(fontsize=7, loc="lower left")
    peaks = ("sampled_emulated_peak_extra_bytes", "full_emulated_peak_extra_bytes",
             "sampled_onepass_peak_extra_bytes", "full_onepass_peak_extra_bytes")  # fmt: skip
    for i, key in enumerate(peaks):
        mem.bar(
            [x + (i - 1.5) * 0.2 for x in range(len(rows))], [r[key] / 2**20 for r in rows], 0.2, label=key
        )
    mem.axhline(VERIFY_TARGETS["sampled_peak_bytes"] / 2**20, color="k", ls="--", label="64 MiB")
    mem.set_xticks(range(len(rows)), labels)
    mem.set_ylabel("extra peak memory, MiB")
    mem.set_title("torch.cuda.max_memory_allocated - allocated before")
    mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_verify(args: argparse.Namespace) -> int:
    """One worker per core install (or the current environment), then JSON, CSV and a plot."""
    import csv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in [] if args.no_run else args.core or ["installed="]:
        version, path = spec.split("=", 1)
        json_path = out / f"verify_te_core{version.replace('.', '')}.json"
        env = dict(os.environ, PYTHONPATH=f"{path}:{REPO}:{os.environ.get('PYTHONPATH', '')}")
        env.update(NO_VCS_VERSION="1", MXFP8_PARAM_KIND="te")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), __file__,
               "verify-worker", "--sizes", args.sizes, "--json", str(json_path)]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)
    # Every core's raw result in the folder, also from earlier invocations (one per core keeps
    # each run inside a time limit), makes one table.
    raws = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("verify_te_core*.json"))}
    rows = [row for raw in raws.values() for row in verify_rows(raw, raw["core"])]
    checks = [
        (f"{r['size']} core {r['core']}: {name}", bool(r[key]))
        for r in rows
        for name, key in (
            ("no false alarm, nothing unchecked", "pass_no_false_alarm"),
            ("peak <= budget", "pass_peak"),
        )
    ] + [
        (f"{r['size']} core {r['core']}: {name}", bool(r[key]))
        for r in rows
        if r["size"] == "4B"
        for name, key in (
            ("TE's rule (fused kernel): sampled <= 0.25 x eval (one-pass)", "pass_sampled_fused_vs_eval"),
            ("TE's rule (fused kernel): full <= 1.0 x eval (one-pass)", "pass_full_fused_vs_eval"),
            ("another rule (own write): sampled <= 0.25 x eval (one-pass)", "pass_sampled_vs_eval"),
            ("another rule (own write): full <= 1.0 x eval (one-pass)", "pass_full_vs_eval"),
        )  # fmt: skip
        if key in r
    ]
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    result = {
        "targets": VERIFY_TARGETS,
        "rows": rows,
        "raw": raws,
        "checks": checks,
        "all_pass": all(c[1] for c in checks),
    }
    (out / "verify_te.json").write_text(json.dumps(result, indent=2))
    with open(out / "verify_te.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    verify_plot(rows, out / "verify_te.png")
    print(f"verify_te: {'PASS' if result['all_pass'] else 'FAIL'} ({out}/verify_te.{{json,csv,png}})")
    return 0


# ----------------------------------------------------------------------------------- driver
#: Targets of issue 12, with the one-pass quantizer (the emulation's ~ten fp32 passes per weight
#: would otherwise dominate both sides): checked at 1B and 4B, in every pass.
TARGETS = {
    "plugin_vs_native": 0.85,
    "plugin_vs_floor": 1.40,
    "host_us_per_param": 5.0,
    "verify_vs_eval_4B": 0.25,
}


_PERSISTENT = (
    "verify_persistent_bytes",
    "verify_plainquant_persistent_bytes",
    "verify_full_persistent_bytes",
    "verify_full_plainquant_persistent_bytes",
)


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios and pass/fail, from the worker results of one pass (both core releases)."""
    old = next((r for v, r in runs.items() if not v.startswith("0.19")), None)
    new = next((r for v, r in runs.items() if v.startswith("0.19")), None)
    rows = []
    for i, size in enumerate(old["sizes"] if old else []):
        row: dict[str, Any] = {"size": size["size"], "params": size["params"]}
        for key in (
            "plugin_full_s",
            "plugin_prestaged_s",
            "plugin_full_plainquant_s",
            "plugin_prestaged_plainquant_s",
            "framework_forced_sync_s",
            "quantize_s",
            "raw_allgather_s",
            "floor_s",
            "plugin_full_allgathers",
            "plugin_prestaged_allgathers",
            "verify_s",
            "verify_plainquant_s",
            "verify_ok",
            "verify_plainquant_ok",
            "verify_peak_extra_bytes",
            "verify_plainquant_peak_extra_bytes",
            "verify_persistent_bytes",
            "verify_plainquant_persistent_bytes",
            "verify_sample",
            "verify_full_s",
            "verify_full_plainquant_s",
            "verify_full_ok",
            "verify_full_plainquant_ok",
            "verify_full_peak_extra_bytes",
            "verify_full_plainquant_peak_extra_bytes",
            "verify_full_persistent_bytes",
            "verify_full_plainquant_persistent_bytes",
        ):
            row[key] = size[key]
        # The verifier against the eval transition it follows (the Bridge callback's path).
        row["ratio_verify_vs_eval"] = size["verify_plainquant_s"] / size["plugin_prestaged_plainquant_s"]
        row["ratio_verify_vs_eval_emulated"] = size["verify_s"] / size["plugin_prestaged_s"]
        # The full check (verify_sample=1.0), reported but not a target.
        row["ratio_verify_full_vs_eval"] = (
            size["verify_full_plainquant_s"] / size["plugin_prestaged_plainquant_s"]
        )
        row["ratio_verify_full_vs_eval_emulated"] = size["verify_full_s"] / size["plugin_prestaged_s"]
        row["peak_extra_bytes_engine"] = size["plugin_peak_extra_bytes_engine"]
        row["peak_extra_bytes_emulated"] = size["plugin_peak_extra_bytes_emulated"]
        row["hooks_per_plain_step_us"] = size["hooks_per_plain_step_s"] * 1e6
        row["hooks_plain_step_allgathers"] = size["hooks_plain_step_allgathers"]
        if new and i < len(new["sizes"]) and "native_s" in new["sizes"][i]:
            nat = new["sizes"][i]
            row["native_0192_s"] = nat["native_s"]
            row["native_0192_plainquant_s"] = nat["native_plainquant_s"]
            row["native_allgathers"] = nat["native_allgathers"]
            row["plugin_0192_prestaged_s"] = nat["plugin_prestaged_s"]
            row["plugin_0192_prestaged_allgathers"] = nat["plugin_prestaged_allgathers"]
            row["ratio_plugin_vs_native_emulated"] = size["plugin_prestaged_s"] / nat["native_s"]
            row["ratio_plugin_vs_native"] = size["plugin_prestaged_plainquant_s"] / nat["native_plainquant_s"]
            # Where the plugin is passive (core 0.19 + Bridge 0.6) the option still verifies.
            row["verify_0192_plainquant_s"] = nat["verify_plainquant_s"]
            row["ratio_verify_vs_native_0192"] = nat["verify_plainquant_s"] / nat["native_plainquant_s"]
        row["ratio_plugin_vs_floor_emulated"] = size["plugin_prestaged_s"] / size["floor_s"]
        row["ratio_plugin_vs_floor"] = size["plugin_prestaged_plainquant_s"] / size["floor_s"]
        row["ratio_plugin_full_vs_floor"] = size["plugin_full_plainquant_s"] / size["floor_s"]
        rows.append(row)
    checks = []
    for row in rows:
        if row["size"] in ("1B", "4B"):
            if "ratio_plugin_vs_native" in row:
                checks.append(
                    (
                        f"{row['size']} plugin (core 0.16.1) / native (core 0.19.2) <= "
                        f"{TARGETS['plugin_vs_native']} (one-pass quantizer)",
                        row["ratio_plugin_vs_native"] <= TARGETS["plugin_vs_native"],
                        row["ratio_plugin_vs_native"],
                    )
                )
            checks.append(
                (
                    f"{row['size']} plugin / physical floor <= {TARGETS['plugin_vs_floor']} "
                    "(one-pass quantizer)",
                    row["ratio_plugin_vs_floor"] <= TARGETS["plugin_vs_floor"],
                    row["ratio_plugin_vs_floor"],
                )
            )
        checks.append(
            (
                f"{row['size']} prestaged all-gathers <= the native path's",
                "native_allgathers" not in row
                or row["plugin_prestaged_allgathers"] <= row["native_allgathers"],
                row["plugin_prestaged_allgathers"],
            )
        )
        checks.append(
            (
                f"{row['size']} extra peak memory (engine) == 0",
                row["peak_extra_bytes_engine"] == 0,
                row["peak_extra_bytes_engine"],
            )
        )
        if row["size"] == "4B":
            checks.append(
                (
                    f"4B verify (sample {row['verify_sample']:.4g}) / eval transition <= "
                    f"{TARGETS['verify_vs_eval_4B']} (one-pass quantizer)",
                    row["ratio_verify_vs_eval"] <= TARGETS["verify_vs_eval_4B"],
                    row["ratio_verify_vs_eval"],
                )
            )
        oks = ("verify_ok", "verify_plainquant_ok", "verify_full_ok", "verify_full_plainquant_ok")
        verified = all(row[k] for k in oks)
        checks.append(
            (
                f"{row['size']} verifier finds the refreshed weights right (both quantizers, sampled, full)",
                verified,
                float(verified),
            )
        )
        checks.append(
            (
                f"{row['size']} verifier leaves no memory allocated",
                max(row[k] for k in _PERSISTENT) == 0,
                max(row[k] for k in _PERSISTENT),
            )
        )
        checks.append(
            (
                f"{row['size']} no collectives on plain steps",
                row["hooks_plain_step_allgathers"] == 0,
                row["hooks_plain_step_allgathers"],
            )
        )
    host = (old or {}).get("host")
    if host:
        us = host["refresh_per_param_s"] * 1e6
        checks.append(("host time per param <= 5 us (whole refresh, incl. core staging)", us <= 5.0, us))
        us = host["engine_loop_per_param_s"] * 1e6
        checks.append(("host time per param <= 5 us (plugin write-back loop)", us <= 5.0, us))
    return {"rows": rows, "host": host, "checks": [{"check": c, "pass": p, "value": v} for c, p, v in checks]}


def plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot at {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["passes"][0]["rows"] if "passes" in summary else summary["rows"]
    labels = [r["size"] for r in rows]
    series = [
        ("plugin, core 0.16.1, emulated quantizer", "plugin_prestaged_s"),
        ("native, core 0.19.2, emulated quantizer", "native_0192_s"),
        ("plugin, core 0.16.1, one-pass quantizer", "plugin_prestaged_plainquant_s"),
        ("native, core 0.19.2, one-pass quantizer", "native_0192_plainquant_s"),
        ("raw all-gather", "raw_allgather_s"),
        ("physical floor", "floor_s"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.13
    for i, (name, key) in enumerate(series):
        vals = [r.get(key, 0.0) * 1e3 for r in rows]
        ax.bar([x + (i - 2.5) * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ms per eval (the Bridge callback's path, first pass)")
    ax.set_yscale("log")
    ax.set_title("MXFP8 param sync around eval, DP=2, H200 + NCCL")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    """Every pass runs one worker per core release, interleaved (0.16.1, 0.19.2, 0.16.1, ...), so a
    drift of the machine shows as a difference between passes rather than between releases."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passes: list[dict[str, Any]] = []
    for n in range(1, args.passes + 1):
        runs: dict[str, dict[str, Any]] = {}
        for spec in args.core:
            version, path = spec.split("=", 1)
            json_path = out / f"eval_sync_core{version.replace('.', '')}_pass{n}.json"
            env = dict(
                os.environ, PYTHONPATH=f"{path}:{REPO}:{os.environ.get('PYTHONPATH', '')}", NO_VCS_VERSION="1"
            )
            host = ["--host-params"] if args.host and n == 1 and not version.startswith("0.19") else []
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(args.nproc),
                __file__,
                "worker",
                "--sizes",
                args.sizes,
                "--json",
                str(json_path),
                *host,
            ]
            print(f"[pass {n}] $", " ".join(cmd), flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            print(f"[pass {n}] core {version}: {time.perf_counter() - t0:.0f} s", flush=True)
            runs[version] = json.loads(json_path.read_text())
        summary = summarize(runs)
        summary["pass"] = n
        summary["runs"] = runs
        passes.append(summary)
        for c in summary["checks"]:
            print(
                f"[pass {n}] {'PASS' if c['pass'] else 'FAIL'}  {c['check']}  ({c['value']:.4g})", flush=True
            )
        result = {
            "targets": TARGETS,
            "passes": passes,
            "all_pass": all(c["pass"] for p in passes for c in p["checks"]),
        }
        # Written after every pass: a run cut short still leaves the passes it finished.
        (out / "eval_sync.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "eval_sync.png")
    print(f"all checks of all {len(passes)} passes: {'PASS' if result['all_pass'] else 'FAIL'}")
    return 0


def replot(args: argparse.Namespace) -> int:
    """Redraw the plot from a committed eval_sync.json (no GPU needed)."""
    path = Path(args.json)
    plot(json.loads(path.read_text()), path.with_suffix(".png"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--sizes", default=DEFAULT_SIZES)
    w.add_argument("--json", required=True)
    w.add_argument("--host-params", action="store_true")
    r = sub.add_parser("run")
    r.add_argument(
        "--core", action="append", required=True, help="VERSION=PYTHONPATH of a megatron-core install"
    )
    r.add_argument("--sizes", default=DEFAULT_SIZES)
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--passes", type=int, default=2, help="interleaved passes; every target must hold in each")
    r.add_argument("--no-host", dest="host", action="store_false", help="skip the 10k-param host-time model")
    r.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    vw = sub.add_parser("verify-worker")
    vw.add_argument("--sizes", default=DEFAULT_SIZES)
    vw.add_argument("--json", required=True)
    v = sub.add_parser("verify", help="the weight verifier on the TE-shaped type (issue 23)")
    v.add_argument("--core", action="append", help="VERSION=PYTHONPATH; default: the installed one")
    v.add_argument("--sizes", default=DEFAULT_SIZES)
    v.add_argument("--nproc", type=int, default=1)
    v.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "verify_te"))
    v.add_argument("--no-run", action="store_true", help="only tabulate the raw results already in --out")
    p = sub.add_parser("replot")
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "eval_sync.json"))
    args = parser.parse_args()
    if args.cmd == "replot":
        return replot(args)
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.cmd == "verify-worker":
        verify_worker(args)
        return 0
    if args.cmd == "verify":
        return run_verify(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
