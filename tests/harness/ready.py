"""Does the plugin ever arm a param gather of an unstaged shared buffer?

Megatron-LM main (#6388) stamps a ready callback on every param when ``overlap_param_gather`` is
on; ``megatron.core.utils.ensure_params_ready`` calls it, and on a bucket group that is not
dispatched (no gather in flight, not published) while the DDP owns the schedule (pre-hooks on) it
STARTS that group's all-gather. Called outside a forward before the main params were staged, it
gathers the gradients in the shared buffer: B2 again. The plugin never calls it, but a consumer
may (GTP prefetch, CUDA-graph replay, an exporter) right after any plugin hook. So after every
hook this records each bucket group the hook turned from dispatched to not dispatched while the
pre-hooks are on, and whether the buffer then holds the staged main params: every fp32 main shard
of the distributed optimizer equals, cast to the buffer dtype, its slice of the param buffer
(the same views and casts as core's ``_copy_main_params_to_param_buffer``; read only, no
collective, so the run is not perturbed).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.launcher import launch
from mbridge_mxfp8_plugin.testing.toy import ToyConfig


@dataclass
class ReadyRun:
    #: (event, groups the hook armed (dispatched -> not dispatched), buffer staged after it)
    armed: list[tuple[str, int, bool]] = field(default_factory=list)
    #: ready-callback calls made while a plugin hook ran
    callbacks_in_hooks: int = 0
    train_losses: list[float] = field(default_factory=list)


def _staged(job: Any) -> bool:
    from mbridge_mxfp8_plugin.engine.plan import StagePlans
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    plans = StagePlans()
    for opt in distributed_optimizers(job.optimizer):
        plan = plans._get(opt)
        assert plan is not None, "an unplannable optimizer layout: the check cannot read it"
        with torch._C.DisableTorchFunctionSubclass():
            if not all(torch.equal(d, s.to(d.dtype)) for d, s in zip(*plan, strict=True)):
                return False
    return True


def _dispatched(job: Any) -> list[bool]:
    from mbridge_mxfp8_plugin.mcore.layout import bucket_groups

    return [bool(g.param_gather_dispatched) for g in bucket_groups(job.model)]


class NaiveReset:
    """What #6388 warns against: re-arm the gathers after a forced sync (defect C's fix alone)
    without staging the main params first. Shows the check sees an unstaged arming."""

    def __init__(self, model: list[Any]) -> None:
        self.model = model

    def on_eval_end(self, context: Any) -> None:
        for chunk in self.model:
            chunk.reset_param_sync_dispatch_state()


def _rank_body(loop: str, naive: bool) -> ReadyRun:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    import types

    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.mcore.layout import bucket_groups
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import build_job

    from .bridge_loop import LoopSchedule, train

    out = ReadyRun()
    inside = [False]
    original = ddp_mod._BucketParamReadyCallback.__call__

    def counted(self: Any) -> None:
        out.callbacks_in_hooks += inside[0]
        original(self)

    ddp_mod._BucketParamReadyCallback.__call__ = counted  # type: ignore[method-assign]
    with cpu_shim(), emulated_mxfp8():
        job = build_job(ToyConfig())
        plugin: Any = NaiveReset(job.model) if naive else MXFP8ParamSyncCallback()

        def wrap(name: str, hook: Any) -> Any:
            def run(_self: Any, ctx: Any) -> None:
                before = _dispatched(job)
                inside[0] = True
                try:
                    hook(ctx)
                finally:
                    inside[0] = False
                # Armed with the pre-hooks off counts too: the loop re-enables them next, and a
                # consumer may then start the gather before anything stages.
                groups = bucket_groups(job.model)
                armed = sum(
                    was and not g.param_gather_dispatched and g.param_gather_handle is None
                    for was, g in zip(before, groups, strict=True)
                )
                if armed:
                    out.armed.append((name, armed, _staged(job)))

            return run

        for name in dir(type(plugin)):
            if name.startswith("on_") and callable(getattr(plugin, name)):
                setattr(plugin, name, types.MethodType(wrap(name, getattr(plugin, name)), plugin))
        schedule = LoopSchedule(train_iters=7, eval_interval=3, eval_iters=1, save_interval=5)
        record = train(job, schedule, [plugin], run_test=True, loop=loop)
    ddp_mod._BucketParamReadyCallback.__call__ = original  # type: ignore[method-assign]
    out.train_losses = list(record.train_losses)
    return out


def run_ready_probe(*, loop: str, naive: bool = False, world_size: int = 2) -> list[ReadyRun]:
    """Per-rank :class:`ReadyRun` of the Bridge ``loop`` order with the plugin (or, ``naive``,
    :class:`NaiveReset`) registered."""
    return launch(_rank_body, world_size, loop, naive)
