"""The adapters' train-start config check: the config the job really runs with, not a file.

Beside the adapters (it reads live DDP chunks and the optimizer, so it stands on the engine's
helpers), and apart from :mod:`.validate`, which must stay importable without torch.
"""

from __future__ import annotations

from typing import Any

from .config.validate import ValidationReport, validate_config

__all__ = ["validate_live_job"]


def validate_live_job(
    model_chunks: Any,
    optimizer: Any,
    *,
    container: Any = None,
    plugin: Any = None,
    strict: bool = True,
) -> ValidationReport | None:
    """The Bridge ``ConfigContainer`` when there is one, else the live megatron-core configs the
    chunks and the distributed optimizer actually run with.

    Returns None when there is nothing megatron-core to check (no DDP chunks, no optimizer).
    """
    import torch.distributed as dist

    from .sync import distributed_optimizers

    dp = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if container is not None and all(hasattr(container, a) for a in ("ddp", "optimizer")):
        return validate_config(container, plugin=plugin, strict=strict)
    ddp = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    opts = distributed_optimizers(optimizer) if optimizer is not None else []
    if ddp is None or not opts:
        return None
    chunk = model_chunks[0]
    group = getattr(chunk, "intra_dp_cp_group", None) or getattr(chunk, "dp_cp_group", None)
    if group is not None and hasattr(group, "size"):
        dp = group.size()
    return validate_config(ddp=ddp, optimizer=opts[0].config, plugin=plugin, dp_size=dp, strict=strict)
