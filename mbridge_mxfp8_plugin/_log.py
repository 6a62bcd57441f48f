"""Rank-zero logging, the way Megatron and Lightning do it: one line per job, not per rank."""

from __future__ import annotations

import logging

logger = logging.getLogger("mbridge_mxfp8_plugin")


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - logging must never raise
        pass
    return 0


def log_rank_zero(level: int, msg: str, *args: object) -> None:
    if _rank() == 0:
        logger.log(level, msg, *args)
