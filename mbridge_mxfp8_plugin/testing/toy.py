"""A tiny model and the megatron-core objects around it, as a training job would build them.

Three linear layers whose weights are MXFP8 (emulated, of the kind ``MXFP8_PARAM_KIND`` selects)
and whose biases stay bf16. Shapes are chosen so that no weight's numel is a multiple of 64: the
distributed optimizer then pads every param start, which is exactly what defect A mis-indexes.

``reference=True`` builds the comparison run: plain bf16 weights, the *same* MXFP8 rounding
applied on the fly in forward (straight-through), no fp8 param gather. Both runs therefore see
bit-identical weights every step, and any difference in their losses is a defect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .emulated_mxfp8 import make_mxfp8_param, mxfp8_quantize, mxfp8_reference_weight

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
    #: Extra ``OptimizerConfig`` fields (e.g. ``overlap_param_gather_with_optimizer_step``).
    extra_opt: dict[str, Any] = field(default_factory=dict)
    #: Split the layers over this many DDP model chunks on every rank (virtual-pipeline style).
    #: Chunk ``i`` calls chunk ``i + 1`` at the end of its forward, so ``model[0](x, y)`` runs the
    #: whole model and every chunk's forward pre-hooks fire in order (PP=1; see tests/harness/robust.py).
    num_chunks: int = 1
    #: Indices of layers whose params do not train (``requires_grad=False``).
    frozen_layers: tuple[int, ...] = ()
    #: > 0: a bf16 embedding table ``(tied_vocab, dims[0])`` used for the input (looked up by
    #: ``argmax(x[:, :tied_vocab])``) and, transposed, as the output projection (tied input/output
    #: embeddings, megatron's ``share_embeddings_and_output_weights`` with PP=1). Needs
    #: ``dims[-1] == dims[0]``; the classes are then ``0..tied_vocab-1``.
    tied_vocab: int = 0
    #: Extra params of these numels in the first chunk, each once as MXFP8 (shape ``(1, n)``)
    #: and once bf16, added to the first layer's output through their means.
    odd_numels: tuple[int, ...] = ()

    @property
    def num_classes(self) -> int:
        return self.tied_vocab or self.dims[-1]


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
            # Same rounding the MXFP8 param applies on write (both copies for the TE-shaped kind).
            w = mxfp8_reference_weight(w)
        return torch.nn.functional.linear(x, w, self.bias)


def _chunk_bounds(n_layers: int, n_chunks: int) -> list[tuple[int, int]]:
    if not 1 <= n_chunks <= n_layers:
        raise ValueError(f"num_chunks={n_chunks} must be between 1 and the number of layers ({n_layers})")
    base, extra = divmod(n_layers, n_chunks)
    bounds, start = [], 0
    for i in range(n_chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _value(p: torch.Tensor, reference: bool) -> torch.Tensor:
    """What forward reads from an MXFP8-in-the-real-run param (straight-through in the reference)."""
    if reference:
        q = mxfp8_quantize(p).to(p.dtype)
        return p + (q - p).detach()
    return p


class _Embedding(torch.nn.Module):
    """A bf16 table looked up for the input; its weight is also the (tied) output projection."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(table.to(torch.bfloat16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class _OddParams(torch.nn.Module):
    """Params of awkward numels (MXFP8 and bf16), added to the activations through their means.

    A module of its own: megatron-core gathers a param in the forward pre-hook of the module that
    *directly* owns it, so every param must sit in a module whose forward runs.
    """

    def __init__(self, mx: list[torch.Tensor], bf: list[torch.Tensor], reference: bool) -> None:
        super().__init__()
        self.reference = reference
        # Direct attributes, not a ParameterList: that would be a module whose forward never runs.
        self.mx_names, self.bf_names = [], []
        for a in mx:
            self.mx_names.append(f"mx{a.numel()}")
            setattr(
                self,
                self.mx_names[-1],
                torch.nn.Parameter(a.to(torch.bfloat16)) if reference else make_mxfp8_param(a),
            )
        for b in bf:
            self.bf_names.append(f"bf{b.numel()}")
            setattr(self, self.bf_names[-1], torch.nn.Parameter(b.to(torch.bfloat16)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shift = torch.zeros((), dtype=torch.float32, device=h.device)
        for name in self.mx_names:
            shift = shift + _value(getattr(self, name), self.reference).float().mean()
        for name in self.bf_names:
            shift = shift + getattr(self, name).float().mean()
        return h + shift.to(h.dtype)


class ToyModel(torch.nn.Module):
    """An MLP classifier; ``forward`` returns the mean cross-entropy.

    With ``cfg.num_chunks > 1`` this is chunk ``chunk`` of the model; all chunks draw the same
    random init sequence and keep their own layers, so the model is the same however it is split.
    """

    def __init__(self, cfg: ToyConfig, device: torch.device | None = None, *, chunk: int = 0) -> None:
        super().__init__()
        # Generated on the target device: an emulated MXFP8 param cannot be moved by
        # Module.to() without losing its class (as with TE's params, which are created in place).
        device = device or torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        n_layers = len(cfg.dims) - 1
        self.first_layer, self.end_layer = _chunk_bounds(n_layers, cfg.num_chunks)[chunk]
        self.is_first = chunk == 0
        self.is_last = chunk == cfg.num_chunks - 1
        self.n_layers = n_layers
        self.reference = cfg.reference
        #: the next DDP chunk (not a submodule: each chunk owns only its own params)
        self.next_chunk: list[Any] = []
        layers = []
        for i, (d_in, d_out) in enumerate(zip(cfg.dims[:-1], cfg.dims[1:], strict=True)):
            w = torch.randn(d_out, d_in, generator=gen, device=device) / d_in**0.5
            b = torch.randn(d_out, generator=gen, device=device) * 0.1
            if self.first_layer <= i < self.end_layer:
                layers.append(_QuantizedLinear(w, b, cfg.reference))
        self.layers = torch.nn.ModuleList(layers)
        for i in cfg.expert_layers:
            if self.first_layer <= i < self.end_layer:
                for p in self.layers[i - self.first_layer].parameters():
                    p.allreduce = False  # type: ignore[attr-defined]  # megatron-core's expert marker
        for i in cfg.frozen_layers:
            if self.first_layer <= i < self.end_layer:
                self.layers[i - self.first_layer].requires_grad_(False)
        self.embed: _Embedding | None = None
        if cfg.tied_vocab:
            if cfg.num_chunks != 1 or cfg.dims[-1] != cfg.dims[0] or cfg.tied_vocab > cfg.dims[0]:
                raise ValueError("tied_vocab needs num_chunks=1, dims[-1] == dims[0] >= tied_vocab")
            self.embed = _Embedding(
                torch.randn(cfg.tied_vocab, cfg.dims[0], generator=gen, device=device) * 0.3
            )
        self.odd: _OddParams | None = None
        if cfg.odd_numels:
            mx = [torch.randn(1, n, generator=gen, device=device) * 0.2 for n in cfg.odd_numels]
            bf = [torch.randn(n, generator=gen, device=device) * 0.2 for n in cfg.odd_numels]
            if self.is_first:
                self.odd = _OddParams(mx, bf, cfg.reference)
        self.tied_vocab = cfg.tied_vocab

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = next(self.parameters()).device
        h, y = x.to(device=device, dtype=torch.bfloat16), y.to(device)
        if self.is_first and self.embed is not None:
            ids = x[:, : self.tied_vocab].argmax(dim=-1).to(device)
            h = h + self.embed(ids)
        for k, layer in enumerate(self.layers):
            h = layer(h)
            i = self.first_layer + k
            if i == 0 and self.odd is not None:
                h = self.odd(h)
            if i < self.n_layers - 1:
                h = torch.nn.functional.gelu(h)
        if not self.is_last:
            return self.next_chunk[0](h, y)
        if self.embed is not None:
            h = torch.nn.functional.linear(h, self.embed.weight)
        return torch.nn.functional.cross_entropy(h.float(), y)


def make_batches(
    cfg: ToyConfig, count: int, *, rank: int, world: int, salt: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per-rank data: the same for reference and MXFP8 runs."""
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + salt * 104729 + i * world + rank)
        x = torch.randn(cfg.micro_batch_size, cfg.dims[0], generator=gen)
        y = torch.randint(0, cfg.num_classes, (cfg.micro_batch_size,), generator=gen)
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
    chunks = []
    for c in range(cfg.num_chunks):
        module = ToyModel(cfg, device, chunk=c)
        chunks.append(DistributedDataParallel(tconfig, ddp_config, module))
    for c in range(cfg.num_chunks - 1):
        chunks[c].module.next_chunk.append(chunks[c + 1])
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
        **cfg.extra_opt,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    return Job(model=chunks, optimizer=optimizer, ddp_config=ddp_config, optimizer_config=opt_config, toy=cfg)
