"""A tiny model and the megatron-core objects around it, as a training job would build them.

Three linear layers whose weights are MXFP8 (emulated) and whose biases stay bf16. Shapes are
chosen so that no weight's numel is a multiple of 64: the distributed optimizer then pads every
param start, which is exactly what defect A mis-indexes.

``reference=True`` builds the comparison run: plain bf16 weights, the *same* MXFP8 rounding
applied on the fly in forward (straight-through), no fp8 param gather. Both runs therefore see
bit-identical weights every step, and any difference in their losses is a defect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .emulated_mxfp8 import make_mxfp8_param, mxfp8_quantize

__all__ = ["ToyConfig", "ToyModel", "build_job", "Job", "make_batches"]


@dataclass(frozen=True)
class ToyConfig:
    """Knobs of a toy job; defaults are the configuration the plugin exists for."""

    dims: tuple[int, ...] = (32, 45, 45, 10)
    seed: int = 1234
    lr: float = 3e-2
    micro_batch_size: int = 8
    bucket_size: int | None = None
    overlap_param_gather: bool = True
    overlap_grad_reduce: bool = True
    grad_reduce_in_fp32: bool = True
    align_param_gather: bool = False
    reference: bool = False
    extra_ddp: dict[str, Any] = field(default_factory=dict)
    #: Indices of layers whose params are expert-parallel (``allreduce=False``): megatron-core
    #: puts them in ``expert_parallel_buffers``, reduced over the expert data-parallel group.
    expert_layers: tuple[int, ...] = ()
    expert_model_parallel_size: int = 1


class _QuantizedLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, reference: bool) -> None:
        super().__init__()
        self.reference = reference
        if reference:
            self.weight = torch.nn.Parameter(weight.to(torch.bfloat16))
        else:
            self.weight = make_mxfp8_param(weight)
        self.bias = torch.nn.Parameter(bias.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        if self.reference:
            # Same rounding the MXFP8 param applies on write; straight-through for the grad.
            q = mxfp8_quantize(w).to(w.dtype)
            w = w + (q - w).detach()
        return torch.nn.functional.linear(x, w, self.bias)


class ToyModel(torch.nn.Module):
    """An MLP classifier; ``forward`` returns the mean cross-entropy."""

    def __init__(self, cfg: ToyConfig, device: torch.device | None = None) -> None:
        super().__init__()
        # Generated on the target device: an emulated MXFP8 param cannot be moved by
        # Module.to() without losing its class (as with TE's params, which are created in place).
        device = device or torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        layers = []
        for d_in, d_out in zip(cfg.dims[:-1], cfg.dims[1:], strict=True):
            w = torch.randn(d_out, d_in, generator=gen, device=device) / d_in**0.5
            b = torch.randn(d_out, generator=gen, device=device) * 0.1
            layers.append(_QuantizedLinear(w, b, cfg.reference))
        self.layers = torch.nn.ModuleList(layers)
        for i in cfg.expert_layers:
            for p in self.layers[i].parameters():
                p.allreduce = False  # type: ignore[attr-defined]  # megatron-core's expert marker

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = next(self.parameters()).device
        h, y = x.to(device=device, dtype=torch.bfloat16), y.to(device)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.nn.functional.gelu(h)
        return torch.nn.functional.cross_entropy(h.float(), y)


def make_batches(
    cfg: ToyConfig, count: int, *, rank: int, world: int, salt: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per-rank data: the same for reference and MXFP8 runs."""
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + salt * 104729 + i * world + rank)
        x = torch.randn(cfg.micro_batch_size, cfg.dims[0], generator=gen)
        y = torch.randint(0, cfg.dims[-1], (cfg.micro_batch_size,), generator=gen)
        out.append((x, y))
    return out


@dataclass
class Job:
    """What a training framework hands the plugin: DDP model chunks and a Megatron optimizer."""

    model: list[Any]
    optimizer: Any
    ddp_config: Any
    optimizer_config: Any
    toy: ToyConfig


def build_job(cfg: ToyConfig) -> Job:
    """Initialise megatron-core parallel state and build DDP + distributed optimizer.

    Call inside :func:`~mbridge_mxfp8_plugin.testing.cpu_shim.cpu_shim` and, for MXFP8 runs,
    :func:`~mbridge_mxfp8_plugin.testing.emulated_mxfp8.emulated_mxfp8`.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            1, 1, expert_model_parallel_size=cfg.expert_model_parallel_size
        )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    try:
        model_parallel_cuda_manual_seed(cfg.seed)
    except Exception:  # noqa: BLE001 - the CUDA RNG tracker is irrelevant on CPU
        pass

    mxfp8 = not cfg.reference
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=True,
        fp8_param_gather=mxfp8,
        reuse_grad_buf_for_mxfp8_param_ag=mxfp8,
        align_param_gather=cfg.align_param_gather,
        bucket_size=cfg.bucket_size,
        **cfg.extra_ddp,
    )
    tconfig = TransformerConfig(
        num_layers=1,
        hidden_size=cfg.dims[1],
        num_attention_heads=1,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    module = ToyModel(cfg, device)
    chunk = DistributedDataParallel(tconfig, ddp_config, module)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        weight_decay=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        overlap_param_gather=cfg.overlap_param_gather,
        fp8_recipe="mxfp8" if mxfp8 else None,
        reuse_grad_buf_for_mxfp8_param_ag=mxfp8,
        clip_grad=0.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [chunk])
    return Job(
        model=[chunk], optimizer=optimizer, ddp_config=ddp_config, optimizer_config=opt_config, toy=cfg
    )
