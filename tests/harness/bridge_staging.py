"""The loop API (``mxfp8_param_sync``) in a loop that stages before every forced sync itself (Megatron-LM
core_v0.19 / Megatron-Bridge 0.6's order), on 2 gloo ranks: :func:`run_api_with_staging_loop`.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.toy import make_batches

from .bridge_orders import loop_order
from .bridge_steps import (
    _TRAIN_MODULE,
    _bridge_train_module,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    force_param_sync,
)

__all__ = ["run_api_with_staging_loop"]

_STAGING_ITERS, _STAGING_EVAL_EVERY, _STAGING_SAVE_EVERY = 6, 2, 3


def _staging_step(job: Any, x: Any, y: Any) -> None:
    """One training step in core_v0.19's order: zero, stage (while pre-hooks are on), forward,
    backward, grad sync, optimizer step."""
    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    if len(job.model[0].remove_forward_pre_hook_handles) > 0:
        job.optimizer.prepare_model_params_for_param_sync()
    loss = job.model[0](x, y)
    loss.backward()
    for chunk in job.model:
        chunk.finish_grad_sync()
    job.optimizer.step()


def _staging_rank() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from harness.bridge_real.costs import CostMeter
    from mbridge_mxfp8_plugin import mxfp8_param_sync
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import evaluate as eval_forwards
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    saved = sys.modules.get(_TRAIN_MODULE)
    sys.modules[_TRAIN_MODULE] = _bridge_train_module(loop_order("0.6.2"))
    meter = CostMeter()
    try:
        with cpu_shim(), emulated_mxfp8(), meter.counting():
            job = build_job(ToyConfig())
            model, opt = job.model, job.optimizer
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            evals = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
            sync = meter.measure("mxfp8_param_sync", 0, model, lambda: mxfp8_param_sync(model, opt))

            def call(name: str, step: int) -> None:
                meter.measure(name, step, model, getattr(sync, name))

            def evaluate(step: int) -> None:
                disable_forward_pre_hook(model, optimizer=opt)
                call("before_eval", step)
                eval_forwards(job, evals)
                enable_forward_pre_hook(model)
                call("after_eval", step)

            for step in range(1, _STAGING_ITERS + 1):
                call("step_started", step)
                ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=step)
                _staging_step(job, x, y)
                if step % _STAGING_EVAL_EVERY == 0:
                    evaluate(step)
                if step % _STAGING_SAVE_EVERY == 0:
                    call("before_save", step)
                    force_param_sync(model, opt)
            disable_forward_pre_hook(model, optimizer=opt)  # the closing forced sync
            call("close", _STAGING_ITERS)
            enable_forward_pre_hook(model)
            evaluate(_STAGING_ITERS)  # a test eval after training
            passive = bool(sync.engine is not None and sync.engine.passive)
    finally:
        if saved is None:
            sys.modules.pop(_TRAIN_MODULE, None)
        else:
            sys.modules[_TRAIN_MODULE] = saved
    return {"passive": passive, "costs": meter.costs}


def run_api_with_staging_loop(world_size: int = 2) -> list[dict[str, Any]]:
    """Per rank: whether the API's engine judged itself passive, and each call's cost.
    The loop API (``mxfp8_param_sync``) in a loop that stages before every forced sync itself.

    Megatron-LM core_v0.19 and Megatron-Bridge 0.6 call ``optimizer.prepare_model_params_for_param_sync()``
    before each step's forwards and before every forced param sync (the eval's pre-hook disable, a
    save's ``force_param_sync``, the closing disable); megatron-core 0.19 writes forced gathers back
    and resets the dispatch state. On such a pair every API call must cost nothing. The loop is the
    toy model's, with this module's helpers (0.6.2 signatures) and that release's ``train``
    module stand-in loaded, which is how the plugin recognises a staging loop.

    Schedule: 6 steps, evals after 2, 4 and 6, a save after 3 and the final one after 6, the closing
    disable, then a test eval. Each API call is measured by ``harness.bridge_real.costs.CostMeter``.
    """
    from mbridge_mxfp8_plugin.testing.launcher import launch

    return launch(_staging_rank, world_size)
