"""A real reuse-mode job whose optimizer includes megatron-core's LayerWiseDistributedOptimizer.

On Megatron-LM main a LayerWise (Muon) job runs DDP with the distributed-optimizer layout and
chains a ``DistributedOptimizer`` (embeddings, biases, norms) with the LayerWise optimizer (the
matrices): the DDP buckets are then not the plugin's to stage or gather. Here the toy job's real
DDP chunks and ``DistributedOptimizer`` are chained with a real ``LayerWiseDistributedOptimizer``
built by its own constructor over one extra bf16 parameter outside DDP (so its step cannot
disturb the DDP buffers), with the job's own ``OptimizerConfig`` (``ChainedOptimizer`` requires
one config for all members). What the plugin does at every Bridge callback is measured from
outside it (:class:`harness.bridge_real.costs.CostMeter`), once with the owner gate and once with
the gate bypassed, which shows the measurement sees the engine's staging and gathers.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.launcher import launch
from mbridge_mxfp8_plugin.testing.toy import ToyConfig


@dataclass
class OwnerRun:
    """One rank's view of a train -> eval -> save -> train run with the plugin registered."""

    #: the class that owns the sync in this run (LayerWise optimizer, or the FSDP wrapper)
    layer_wise_class: str = ""
    #: (event, plugin all-gathers, other collectives, stagings, buffers/params written)
    costs: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    inactive_reason: str | None = None
    engine_built: bool = False
    train_losses: list[float] = field(default_factory=list)


class _Lines(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.levelno} {record.getMessage()}")


def _costs(meter: Any) -> list[tuple[str, int, int, int, int]]:
    return [(c.event, c.all_gathers, c.other_collectives, c.stagings, len(c.writes)) for c in meter.costs]


def _layer_wise(job: Any) -> Any:
    """The job's optimizer chained with a real LayerWise optimizer (see the module docstring)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    extra = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))
    extra.main_grad = torch.zeros(64, 64, dtype=torch.float32)  # what DDP gives its params
    wanted = inspect.signature(LayerWiseDistributedOptimizer.__init__).parameters
    # model_chunks=[]: no DDP bucket is handed to LayerWise (its overlap path would take them).
    kwargs = {"model_chunks": []} if "model_chunks" in wanted else {}
    layer_wise = LayerWiseDistributedOptimizer(
        [torch.optim.Adam([extra], lr=0.0)],
        job.optimizer_config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        **kwargs,
    )
    members = list(getattr(job.optimizer, "chained_optimizers", [job.optimizer]))
    return ChainedOptimizer([*members, layer_wise]), layer_wise


def _rank_body(gate: bool, loop: str) -> OwnerRun:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.common.log import logger
    from mbridge_mxfp8_plugin.engine import applies, sync
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import build_job

    from .bridge_loop import LoopSchedule, train
    from .bridge_real.costs import CostMeter

    out = OwnerRun()
    if not gate:  # the plugin as it would be without the owner gate
        applies.sync_owner = lambda *a, **k: None  # type: ignore[assignment]
        sync.optimizer_sync_owner = lambda *a, **k: None  # type: ignore[assignment]
    handler = _Lines(out.log_lines)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with cpu_shim(), emulated_mxfp8():
            job = build_job(ToyConfig())
            job.optimizer, layer_wise = _layer_wise(job)
            out.layer_wise_class = f"{type(layer_wise).__module__}.{type(layer_wise).__qualname__}"
            plugin = MXFP8ParamSyncCallback()
            meter = CostMeter()
            schedule = LoopSchedule(train_iters=5, eval_interval=2, eval_iters=1, save_interval=3)
            with meter.counting():
                record = train(job, schedule, [meter.wrap(plugin)], run_test=True, loop=loop)
    finally:
        logger.removeHandler(handler)
    out.costs = [
        (c.event, c.all_gathers, c.other_collectives, c.stagings, len(c.writes)) for c in meter.costs
    ]
    out.inactive_reason = plugin.inactive_reason
    out.engine_built = plugin.engine is not None
    out.train_losses = list(record.train_losses)
    return out


def _fsdp_rank_body() -> OwnerRun:
    """A real Megatron-FSDP wrapper (CPU, gloo) through the plugin's Bridge events, in order."""
    warnings.filterwarnings("ignore")
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import FullyShardedDataParallel
    from megatron.core.transformer import TransformerConfig

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
    from mbridge_mxfp8_plugin.common.log import logger
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim

    from .bridge_real.costs import CostMeter

    out = OwnerRun()
    handler = _Lines(out.log_lines)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with cpu_shim():
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(1, 1)
            torch.manual_seed(0)
            fields = DistributedDataParallelConfig.__dataclass_fields__
            # gloo has no PREMUL_SUM, which the fused gradient division uses
            no_fusion = (
                {"gradient_reduce_div_fusion": False} if "gradient_reduce_div_fusion" in fields else {}
            )
            ddp_config = DistributedDataParallelConfig(
                **no_fusion,
                use_megatron_fsdp=True,
                use_distributed_optimizer=True,
                data_parallel_sharding_strategy="optim_grads_params",
                overlap_param_gather=True,
                overlap_grad_reduce=True,
            )
            module = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
            model = FullyShardedDataParallel(
                TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1),
                ddp_config,
                module,
                fsdp_unit_modules=[torch.nn.Linear],
                device=torch.device("cpu"),
            )
            out.layer_wise_class = f"{type(model).__module__}.{type(model).__qualname__}"
            plugin, meter = MXFP8ParamSyncCallback(), CostMeter()
            ctx = SimpleNamespace(model=[model], optimizer=None, state=None)

            def weights() -> dict[str, torch.Tensor]:  # each rank's shard (FSDP params are DTensors)
                local = {n: p.detach() for n, p in model.named_parameters()}
                return {n: (t.to_local() if hasattr(t, "to_local") else t).clone() for n, t in local.items()}

            def hook(event: str) -> None:
                # Bridge's on_checkpoint_save hands unwrap_model(model): no FSDP wrapper in sight.
                seen = SimpleNamespace(model=[model.module]) if event == "on_checkpoint_save" else ctx
                before = weights()
                meter.measure(event, 0, [], lambda: getattr(plugin, event)(seen))
                after = weights()
                meter.costs[-1].writes = [n for n in before if not torch.equal(before[n], after[n])]

            with meter.counting():
                for event in ("on_train_start", "on_train_step_start"):
                    hook(event)
                with torch.no_grad():  # a forward (its param gathers are FSDP's, outside the hooks);
                    model(torch.randn(4, 32))  # no backward: the CPU shim has no stream events
                for event in ("on_train_step_end", "on_eval_start", "on_eval_end", "on_checkpoint_save"):
                    hook(event)
                hook("on_train_end")
    finally:
        logger.removeHandler(handler)
    out.costs = [
        (c.event, c.all_gathers, c.other_collectives, c.stagings, len(c.writes)) for c in meter.costs
    ]
    out.inactive_reason, out.engine_built = plugin.inactive_reason, plugin.engine is not None
    return out


def run_fsdp_job(world_size: int = 2) -> list[OwnerRun]:
    """Per-rank :class:`OwnerRun` of a Megatron-FSDP model through the plugin's Bridge events."""
    return launch(_fsdp_rank_body, world_size)


def run_layer_wise_job(*, gate: bool = True, loop: str = "0.3.1", world_size: int = 2) -> list[OwnerRun]:
    """Per-rank :class:`OwnerRun` of the Bridge ``loop`` release's order on ``world_size`` ranks."""
    return launch(_rank_body, world_size, gate, loop)
