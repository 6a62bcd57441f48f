"""The pieces of a real-pretrain run that defect F's comparison needs (JobSpec ``plant_band``,
``resume_fix``, ``record_final``): the worker calls them; tests/bridge_real/test_resume_real.py
asserts on what they record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from harness.resume_loop import param_tensors


def plant_band(init: torch.Tensor) -> torch.Tensor:
    """Init values whose 32-element row blocks each hold one element of 1.0 and the rest
    ~N(0, 1e-4): about a quarter of those are E4M3-subnormal in their row block and normal in
    their (small) column block, so the column-wise copy re-quantized on load differs from the one
    quantized from bf16(main) (F made visible; with Gaussian init ~1 element in 10^4 is there).
    Deterministic per shape, so every run of a comparison starts from the same weights."""
    gen = torch.Generator().manual_seed(int(init.numel()) * 31 + int(init.shape[0]))
    w = torch.randn(init.shape, generator=gen) * 1e-4
    w.view(w.shape[0], -1, 32)[:, :, 0] = 1.0
    return w.to(device=init.device, dtype=init.dtype)


def final_tensors(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every tensor each param holds (a TE-shaped param's codes and scales in both directions) and
    every fp32 main shard of the distributed optimizer, by name."""
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            out.update(param_tensors(f"{i}.{name}", p))
    for k, opt in enumerate(distributed_optimizers(optimizer) if optimizer is not None else []):
        for g, group in enumerate(opt.shard_fp32_from_float16_groups):
            for j, main in enumerate(group):
                out[f"main.{k}.{g}.{j}"] = main.detach().clone()
    return out


@contextlib.contextmanager
def resume_fix(on: bool) -> Iterator[None]:
    """``on=False``: the plugin's re-derivation after a load does nothing (the rest of the plugin
    runs), to show what F does to a resumed run."""
    from mbridge_mxfp8_plugin.engine import resume as resume_mod
    from mbridge_mxfp8_plugin.engine.sync import SyncStats

    saved = resume_mod.rederive_after_load
    if not on:
        resume_mod.rederive_after_load = lambda engine, **kw: SyncStats(note="resume: fix off (test)")
    try:
        yield
    finally:
        resume_mod.rederive_after_load = saved


@contextlib.contextmanager
def dequantize_before_load() -> Iterator[None]:
    """megatron-core 0.19's torch_dist loader dequantizes quantized params one tensor at a time
    while it reads (``stream_ckpt_dequant``, on by default), but only with Transformer Engine
    imported and the param on CUDA; on a CPU host with the kit's TE-shaped params it would read
    the file straight into the quantized param. Off here, core dequantizes every quantized param
    before the read (``force_all_tensors_to_non_fp8``, what releases < 0.19 always do), and the
    load writes the bf16 values back through each param's ``copy_``: the same re-quantization of
    the same bf16 values as TE's streaming path. Only for the TE-shaped kind (the value-holding
    param takes the load as it is); nothing to do on cores without the knob."""
    from mbridge_mxfp8_plugin.testing import param_kind

    try:
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    except ImportError:
        yield
        return
    if param_kind() != "te":
        yield
        return
    init = TorchDistLoadShardedStrategy.__init__

    def without_streaming(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if hasattr(self, "stream_ckpt_dequant"):
            self.stream_ckpt_dequant = False

    TorchDistLoadShardedStrategy.__init__ = without_streaming  # type: ignore[method-assign]
    try:
        yield
    finally:
        TorchDistLoadShardedStrategy.__init__ = init  # type: ignore[method-assign]
