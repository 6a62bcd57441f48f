"""What both framework adapters do the same way: decide whether the plugin applies, bind the shared
engine with one rank-zero log line, and check the job at train start.

Kept apart from the engine because it is about user-facing policy (what to log, what to refuse),
and apart from each adapter so that Bridge and Lightning cannot drift.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ._log import log_rank_zero
from .buckets import is_megatron_ddp
from .errors import MXFP8UsageError
from .sync import ParamSyncEngine, distributed_optimizers, reuse_mode_active

__all__ = ["bind_engine", "check_job", "inactive_reason"]


def inactive_reason(chunks: Sequence[Any]) -> str | None:
    """Why the plugin has nothing to do for these chunks, or None when it applies."""
    if not all(is_megatron_ddp(m) for m in chunks):
        kinds = sorted({type(m).__name__ for m in chunks})
        return (
            f"model chunks are {kinds}, not megatron-core DistributedDataParallel "
            "(Megatron-FSDP and torch DDP do not have these defects)"
        )
    if not reuse_mode_active(chunks):
        return "reuse_grad_buf_for_mxfp8_param_ag is off or the distributed optimizer is not used"
    return None


def bind_engine(
    chunks: Sequence[Any], optimizer: Any | None, *, repair_alignment: bool, framework: str
) -> tuple[ParamSyncEngine | None, str | None]:
    """The shared engine of these chunks, prepared (offsets repaired), or (None, why not) with one
    rank-zero log line either way."""
    reason = inactive_reason(chunks)
    if reason:
        log_rank_zero(logging.INFO, "MXFP8 param-sync plugin inactive: %s; nothing to do.", reason)
        return None, reason
    engine = ParamSyncEngine.shared(chunks, optimizer)
    report = engine.prepare(repair_offsets=repair_alignment)
    beh = engine.behaviour
    log_rank_zero(
        logging.INFO,
        "MXFP8 param-sync plugin active (%s, %d chunk(s)): %s; core forced-sync write-back=%s, "
        "dispatch reset=%s",
        framework,
        len(chunks),
        report.summary() if report else "no buckets",
        beh.forced_sync_writes_back,
        beh.has_dispatch_reset,
    )
    return engine, None


def check_job(
    engine: ParamSyncEngine,
    *,
    container: Any,
    plugin: dict[str, Any],
    validate: bool,
    strict: bool,
    owner: str,
) -> None:
    """Refuse at train start what would otherwise fail (or train wrong) at the first eval."""
    if engine.optimizer is not None and not distributed_optimizers(engine.optimizer):
        raise MXFP8UsageError(
            f"the optimizer handed to {owner} is {type(engine.optimizer).__name__}, which holds no "
            "megatron-core DistributedOptimizer: with reuse_grad_buf_for_mxfp8_param_ag the fp32 main "
            "params live only there. Build it with megatron.core.optimizer.get_megatron_optimizer and "
            "OptimizerConfig(use_distributed_optimizer=True)"
        )
    if not validate:
        return
    from .live_check import validate_live_job

    report = validate_live_job(
        engine.model_chunks, engine.optimizer, container=container, plugin=plugin, strict=strict
    )
    if report is not None and not report.ok:
        log_rank_zero(logging.WARNING, "MXFP8 config problems (strict=False):\n%s", report.format_errors())
