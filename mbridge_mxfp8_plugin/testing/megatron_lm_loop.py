"""Megatron-LM's train step and evaluation, in its order, for a :class:`~.toy.Job`.

Megatron-LM's ``megatron/training/training.py`` has no callbacks: a user adds
:func:`mxfp8_param_sync`'s calls to their own copy of ``train()``. To test such a loop on a laptop
you need ``train_step`` and ``evaluate`` to touch megatron-core's buffers exactly as Megatron-LM
does, because defects B and C live in that order (who zeroes the grad buffer, who copies main
params into it and when, which forced gather a step skips). These follow ``training.py`` at tag
``core_v0.16.1`` (line numbers in the comments), cut to one microbatch and no pipelining.
``mxfp8-plugin demo`` and the suite's Megatron-LM-order loop both drive them; write the loop
around them (iterations, pre-hook toggles, evals, saves) as your own ``train()`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..mcore.layout import bucket_groups

__all__ = ["dp_mean", "evaluate", "skipped_param_gathers", "train_step"]


def dp_mean(value: Any) -> float:
    """``value`` (a scalar tensor or number) averaged over every rank of the default group: the loss
    a rank-0 report shows is then the same on every rank and comparable between runs."""
    t = torch.as_tensor(value).detach().float().reshape(1).clone()
    torch.distributed.all_reduce(t)
    return float(t.item() / torch.distributed.get_world_size())


def skipped_param_gathers(model: list[Any]) -> int:
    """Bucket groups marked "gather dispatched" with no gather in flight: the next forwards skip
    their all-gather and copy-back (defect C's signature). Diagnostics only; no loop needs it."""
    return sum(1 for g in bucket_groups(model) if g.param_gather_dispatched and g.param_gather_handle is None)


def train_step(job: Any, x: Any, y: Any, skipped_gathers: list[int] | None = None) -> float:
    """``train_step`` (L1603-1703) on ``job``'s model and optimizer; returns the DP-mean loss.

    ``skipped_gathers``, when given, gets :func:`skipped_param_gathers` as the forwards begin:
    what this step will miss if a forced sync left dispatch state behind.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model, optimizer = job.model, job.optimizer
    for chunk in model:  # L1614-1616
        chunk.zero_grad_buffer()
    optimizer.zero_grad()  # L1619
    # L1641-1647: with the grad buffer reused for the param gather, the loop itself copies the
    # main params into it, but only while the forward pre-hooks are on.
    if job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag and job.ddp_config.overlap_param_gather:
        if len(model[0].remove_forward_pre_hook_handles) > 0:
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                if isinstance(opt, DistributedOptimizer):
                    opt._copy_main_params_to_param_buffer()
    if skipped_gathers is not None:
        skipped_gathers.append(skipped_param_gathers(model))
    loss = model[0](x, y)  # forward_backward_func (L1652)
    loss.backward()
    for chunk in model:  # finalize_model_grads -> finish_grad_sync
        chunk.finish_grad_sync()
    optimizer.step()  # L1703
    return dp_mean(loss)


def evaluate(job: Any, batches: list[Any]) -> float:
    """``evaluate``: eval mode, forwards without grad, back to train mode;
    returns the DP-mean loss over ``batches``. The forced param sync before it is the caller's
    (Megatron-LM's ``train()`` toggles the pre-hooks around it)."""
    for chunk in job.model:
        chunk.eval()
    with torch.no_grad():
        losses = [job.model[0](x, y) for x, y in batches]
    for chunk in job.model:
        chunk.train()
    return dp_mean(torch.stack(losses).mean())
