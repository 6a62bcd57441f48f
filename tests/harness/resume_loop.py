"""Interrupt and resume a toy job on real megatron-core, in Megatron-LM's or Bridge 0.6's order (F).

A checkpoint here holds what a real one holds, taken in process: every model weight as bf16 (an
MXFP8 param dequantized, as megatron-core's save does) and the distributed optimizer's state (the
fp32 main shards and Adam's moments and step). Loading writes the weights back through each
param's own ``copy_`` (``load_state_dict``: an MXFP8 param quantizes again, as TE's does) and the
optimizer state into a freshly built job. Bridge's real ``pretrain()`` with torch_dist files runs
the same comparison in tests/bridge_real/test_resume_real.py; this tier runs it in seconds, in every
release cell, with the loop API.

Loop orders (:data:`ORDERS`): ``megatron_lm`` (Megatron-LM's ``train()`` and Bridge <= 0.5: the
first step of every run, a resumed one included, runs with the forward pre-hooks off), and
``hooks_on_resume`` (Bridge >= 0.6 for an MXFP8 recipe: a resumed run keeps them on, so its first
step stages and gathers the main params). Evaluations run at :data:`EVALS` with a forced sync.

``ckpt_weights``: ``current`` (what a correct save holds: the plugin made the weights the quantized
main params first) or ``unrefreshed`` (``param.data`` after the loop's forced sync with nothing
staged, what a save without the plugin writes: the previous iteration's weights on megatron-core
< 0.18, gathered gradients on later cores). Either way the optimizer state is right.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

ITERS = 6
#: the checkpoint is taken after this many iterations
SAVE_AT = 3
#: evaluations after these iterations (forced sync, pre-hooks toggled around)
EVALS = (4, 6)
ORDERS = ("megatron_lm", "hooks_on_resume")
#: the toy's input width (its first layer's weight is the only one of that width)
FIRST_WIDTH = 32


@dataclass
class ResumeRecord:
    """What one run produced on one rank (losses are DP means: equal on every rank)."""

    train_losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    #: every tensor each param holds (values, or codes and scales) and every fp32 main shard
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the plugin's events with their notes, and the param all-gathers each issued
    history: list[tuple[str, str, int]] = field(default_factory=list)


def param_tensors(name: str, param: Any) -> dict[str, torch.Tensor]:
    """Every tensor a param holds: a TE-shaped MXFP8 param's codes and scales (row- and
    column-wise, the tensors in its ``__dict__``), else its values."""
    held = {
        f"{name}.{k}": v.detach().clone()
        for k, v in vars(param).items()
        if isinstance(v, torch.Tensor) and not k.startswith("_high_precision")
    }
    if held:
        return held
    with torch._C.DisableTorchFunctionSubclass():
        return {name: torch.Tensor.clone(param.detach())}


def final_state(job: Any) -> dict[str, torch.Tensor]:
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(job.model):
        for name, p in chunk.module.named_parameters():
            out.update(param_tensors(f"{i}.{name}", p))
    for k, opt in enumerate(distributed_optimizers(job.optimizer)):
        for g, group in enumerate(opt.shard_fp32_from_float16_groups):
            for j, main in enumerate(group):
                out[f"main.{k}.{g}.{j}"] = main.detach().clone()
    return out


def saved_values(param: Any) -> torch.Tensor:
    """The bf16 values a checkpoint stores for a param (an MXFP8 param dequantized)."""
    if hasattr(param, "dequantize"):
        return param.dequantize().to(torch.bfloat16).clone()
    return param.detach().clone()


def take_checkpoint(job: Any) -> dict[str, Any]:
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    model = [{n: saved_values(p) for n, p in c.module.named_parameters()} for c in job.model]
    opts = []
    for opt in distributed_optimizers(job.optimizer):
        mains = [m.detach().clone() for group in opt.shard_fp32_from_float16_groups for m in group]
        inner = [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[m].items()}
            for group in opt.shard_fp32_from_float16_groups
            for m in group
        ]
        opts.append((mains, inner))
    return {"model": model, "optimizer": opts}


def load_checkpoint(job: Any, ckpt: dict[str, Any]) -> None:
    """Into a freshly built job: the weights through each param's ``copy_`` (re-quantizing an
    MXFP8 param, as a real load does), the optimizer state as stored."""
    with torch.no_grad():
        for chunk, state in zip(job.model, ckpt["model"], strict=True):
            chunk.module.load_state_dict(state, strict=True)
    load_optimizer_state(job, ckpt["optimizer"])


def load_optimizer_state(job: Any, saved: list[Any]) -> None:
    """The fp32 main shards and Adam's state of each distributed optimizer, as stored."""
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    with torch.no_grad():
        for opt, (mains, inner) in zip(distributed_optimizers(job.optimizer), saved, strict=True):
            own = [m for group in opt.shard_fp32_from_float16_groups for m in group]
            for main, value, state in zip(own, mains, inner, strict=True):
                main.copy_(value)
                opt.optimizer.state[main] = {
                    k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()
                }


class _Loop:
    """Megatron-LM's ``train()`` around the kit's ``train_step``/``evaluate``, with the loop API."""

    def __init__(self, job: Any, order: str, plugin: bool, rec: ResumeRecord) -> None:
        from mbridge_mxfp8_plugin.adapters.loop import mxfp8_param_sync

        self.job, self.order, self.rec = job, order, rec
        self.toggle = job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather
        self.sync = mxfp8_param_sync(job.model, job.optimizer) if plugin else None

    def _hooks(self, on: bool, **kwargs: Any) -> None:
        if self.toggle:
            for chunk in self.job.model:
                (chunk.enable_forward_pre_hook if on else chunk.disable_forward_pre_hook)(**kwargs)

    def run(self, start: int, stop: int, *, resumed: bool, ckpt_weights: str = "current") -> Any:
        from mbridge_mxfp8_plugin.testing.megatron_lm_loop import evaluate, train_step
        from mbridge_mxfp8_plugin.testing.toy import make_batches

        job, sync, rec = self.job, self.sync, self.rec
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        evals = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
        hooks_on = resumed and self.order == "hooks_on_resume"
        if not hooks_on:  # the first step runs without pre-hooks (no sync)
            self._hooks(False, param_sync=False)
        if resumed and sync is not None:
            sync.after_load()
        ckpt = None
        for it in range(start, stop):
            if sync is not None:
                sync.step_started()
            ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=it)
            rec.train_losses[it + 1] = train_step(job, x, y)
            if it == start and not hooks_on:
                self._hooks(True)
            if it + 1 in EVALS:
                self._hooks(False)  # forced all-gather
                if sync is not None:
                    sync.before_eval()
                rec.eval_losses[it + 1] = evaluate(job, evals)
                self._hooks(True)
                if sync is not None:
                    sync.after_eval()
            if it + 1 == SAVE_AT and stop == SAVE_AT:
                if sync is not None and ckpt_weights == "current":
                    sync.before_save()
                if self.toggle:
                    for chunk in job.model:
                        chunk.start_param_sync(force_sync=True)
                ckpt = take_checkpoint(job)
        self._hooks(False)  # the closing forced sync
        if sync is not None:
            sync.close()
            rec.history = [(e, s.note, s.all_gathers) for e, s in sync.history]
        rec.final = final_state(job)
        return ckpt


def _resumed(job: Any, order: str, *, fix: bool) -> ResumeRecord:
    """Train a job that was just loaded from SAVE_AT to the end, with the F fix on or patched out."""
    from mbridge_mxfp8_plugin.engine import resume as resume_mod
    from mbridge_mxfp8_plugin.engine.sync import SyncStats

    rec = ResumeRecord()
    saved = resume_mod.rederive_after_load
    if not fix:
        resume_mod.rederive_after_load = lambda engine, **kw: SyncStats(note="resume: fix off (test)")
    try:
        _Loop(job, order, True, rec).run(SAVE_AT, ITERS, resumed=True)
    finally:
        resume_mod.rederive_after_load = saved
    return rec


class _Cases:
    """The uninterrupted run and the checkpoint, built once per (planted band, checkpoint weights)
    and shared by every case that needs them (the order only matters after a resume)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.full: dict[bool, ResumeRecord] = {}
        self.ckpt: dict[tuple[bool, str], dict[str, Any]] = {}

    def run(self, order: str, *, fix: bool, ckpt_weights: str, plant: bool) -> dict[str, ResumeRecord]:
        from mbridge_mxfp8_plugin.testing.toy import build_job

        cfg = toy_config(self.kind, plant)
        with planted_band(plant):
            if plant not in self.full:
                self.full[plant] = ResumeRecord()
                _Loop(build_job(cfg), "megatron_lm", True, self.full[plant]).run(0, ITERS, resumed=False)
            if (plant, ckpt_weights) not in self.ckpt:
                first = _Loop(build_job(cfg), "megatron_lm", True, ResumeRecord())
                self.ckpt[plant, ckpt_weights] = first.run(
                    0, SAVE_AT, resumed=False, ckpt_weights=ckpt_weights
                )
            job = build_job(cfg)
        load_checkpoint(job, self.ckpt[plant, ckpt_weights])
        return {"full": self.full[plant], "resumed": _resumed(job, order, fix=fix)}


def toy_config(kind: str, plant: bool) -> Any:
    """Widths that are multiples of 32 (whole MXFP8 blocks in both directions), three layers so
    that the backward pass reads two weights' column-wise copies; with the planted band, a
    learning rate small enough to keep its elements in place."""
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig

    return ToyConfig(dims=(FIRST_WIDTH, 96, 64, 32), lr=1e-4 if plant else 3e-2, micro_batch_size=16)


class planted_band:
    """Init the MXFP8 weights behind the first layer so that each 32-element row block holds one
    element of 1.0 and the rest ~N(0, 1e-4): about a quarter of those are E4M3-subnormal in their
    row block (below 2**-14.8 of its max) while their column blocks are small, so the column-wise
    copy quantized from bf16(main) and the one quantized from dequantized row-wise values differ
    (F made visible on purpose; with Gaussian init about 1 element in 10^4 is in that range). A
    small learning rate keeps them there. The first layer's weight stays as the toy makes it: no
    input gradient reads its column-wise copy."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        from mbridge_mxfp8_plugin.testing import toy

        self._saved = toy.make_mxfp8_param
        if not self.on:
            return
        original = self._saved

        def make(init: torch.Tensor) -> Any:
            if init.shape[-1] == FIRST_WIDTH:  # the first layer: no input gradient reads it
                return original(init)
            gen = torch.Generator().manual_seed(int(init.numel()))
            w = torch.randn(init.shape, generator=gen) * 1e-4
            w.view(w.shape[0], -1, 32)[:, :, 0] = 1.0
            return original(w.to(init.device))

        toy.make_mxfp8_param = make

    def __exit__(self, *exc: Any) -> None:
        from mbridge_mxfp8_plugin.testing import toy

        toy.make_mxfp8_param = self._saved


def rank_body(cases: list[tuple[str, str, bool, str, bool]]) -> list[dict[str, ResumeRecord]]:
    """``cases``: (order, param kind, fix on, checkpoint weights, planted band); the kind is the
    kit's ``MXFP8_PARAM_KIND`` (``values`` or ``te``), set here for each case."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    shared: dict[str, _Cases] = {}
    out = []
    with cpu_shim():
        for order, kind, fix, weights, plant in cases:
            os.environ["MXFP8_PARAM_KIND"] = kind
            with emulated_mxfp8():
                cases_of_kind = shared.setdefault(kind, _Cases(kind))
                out.append(cases_of_kind.run(order, fix=fix, ckpt_weights=weights, plant=plant))
    return out
