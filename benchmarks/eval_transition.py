"""The eval transition's cost on one model size (emulated-MXFP8 weights, bf16 biases), the part
of ``eval_sync.py worker`` that times the param sync itself:

* ``plugin_full``: the plugin gathers itself (``before_eval`` with no forced sync before it);
* ``plugin_prestaged``: the Bridge adapter's path, one gather in total;
* ``native``: core 0.19's ``prepare_model_params_for_param_sync`` + forced sync (where core has it);
* each again with the one-pass quantizer (``*_plainquant``); ``quantize``: the MXFP8 write-back
  alone; all-gathers per eval and extra peak memory;
* the physical floor: the bytes the necessary copies move over the measured device-to-device
  bandwidth, plus a raw NCCL all-gather of the same size.

``eval_sync.py``'s docstring says what each figure means.
"""

from __future__ import annotations

from typing import Any

from _casts import plain_quantizer
from _job import GatherCounter, framework_forced_sync, peak_extra, prestaged_transition, timeit


def plugin_full(engine: Any) -> None:
    """The loop API's path: stage main params, all-gather, write back, ``after_forced_sync``."""
    engine.before_eval(gathered_fresh=False)
    engine.after_forced_sync()


def _allgathers(counter: GatherCounter, reset: Any, fn: Any) -> int:
    """All-gathers one call of ``fn`` issues, after ``reset``."""
    counter.take()
    reset()
    fn()
    return counter.take()


def measure_plugin(job: Any, engine: Any, counter: GatherCounter, reset: Any) -> dict[str, Any]:
    """The plugin's two paths (emulated and one-pass quantizer), the framework's forced gather
    alone, the MXFP8 write-back alone, all-gathers per eval and extra peak memory."""
    import torch

    def full() -> None:
        plugin_full(engine)

    def prestaged() -> None:
        prestaged_transition(job, engine)

    res: dict[str, Any] = {}
    res["plugin_full_s"] = timeit(full, reset)
    res["plugin_full_allgathers"] = _allgathers(counter, reset, full)
    res["plugin_prestaged_s"] = timeit(prestaged, reset)
    res["plugin_prestaged_allgathers"] = _allgathers(counter, reset, prestaged)
    # The plugin's own share of the prestaged path (the forced gather is the framework's).
    res["framework_forced_sync_s"] = timeit(lambda: framework_forced_sync(job), reset)

    # Write-back of MXFP8 params alone = the emulated quantization's cost.
    mx = [p for p in job.model[0].parameters() if type(p).__name__ == "EmulatedMXFP8Tensor"]
    srcs = [torch.empty_like(p.detach(), dtype=torch.bfloat16) for p in mx[:1]]

    def quantize_all() -> None:
        for p in mx:
            p.data.copy_(srcs[0] if srcs[0].shape == p.shape else p.detach())

    res["quantize_s"] = timeit(quantize_all)
    reset()
    res["plugin_peak_extra_bytes_emulated"] = peak_extra(full)
    with plain_quantizer():
        reset()
        res["plugin_peak_extra_bytes_engine"] = peak_extra(full)
        res["plugin_full_plainquant_s"] = timeit(full, reset)
        res["plugin_prestaged_plainquant_s"] = timeit(prestaged, reset)
    return res


def measure_native(job: Any, counter: GatherCounter, reset: Any) -> dict[str, Any]:
    """Core 0.19's own path (nothing where this core has no ``prepare_model_params_for_param_sync``)."""
    from mbridge_mxfp8_plugin import ParamSyncEngine
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    res: dict[str, Any] = {}
    core = ParamSyncEngine(job.model, job.optimizer).behaviour
    if not core.has_prepare_for_param_sync:
        return res
    opt = job.optimizer

    def native() -> None:
        if hasattr(opt, "prepare_model_params_for_param_sync"):
            opt.prepare_model_params_for_param_sync()
        else:
            for o in distributed_optimizers(opt):
                o.prepare_model_params_for_param_sync()
        framework_forced_sync(job)

    res["native_s"] = timeit(native, reset)
    with plain_quantizer():
        res["native_plainquant_s"] = timeit(native, reset)
    res["native_allgathers"] = _allgathers(counter, reset, native)
    reset()
    res["native_peak_extra_bytes_emulated"] = peak_extra(native)
    return res


def measure_floor(job: Any, engine: Any, n_params: int) -> dict[str, Any]:
    """Physical floor, measured in this process: copy bandwidth and a raw all-gather of the size."""
    import torch

    elems = sum(b.param_data.numel() for g in engine.bucket_groups() for b in g.buckets)
    dev = job.model[0].module.layers[0].bias.device
    big = torch.empty(max(elems, 1 << 26), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(big)
    t_copy = timeit(lambda: dst.copy_(big))
    bw = 2 * big.numel() * big.element_size() / t_copy  # bytes read + written per second
    world = torch.distributed.get_world_size()
    shard = big[: elems // world]
    out = big.new_empty(shard.numel() * world)
    res: dict[str, Any] = {}
    res["raw_allgather_s"] = timeit(lambda: torch.distributed.all_gather_into_tensor(out, shard))
    n = n_params
    # stage: read fp32 shard + write bf16 shard; write-back: read bf16 + write the param
    # (emulation stores bf16). No re-zeroing: the next step's zero_grad_buffer does it.
    res["floor_copy_bytes"] = int((4 + 2) * n / world + (2 + 2) * n)
    res["copy_bandwidth_Bps"] = bw
    res["floor_s"] = res["floor_copy_bytes"] / bw + res["raw_allgather_s"]
    return res
