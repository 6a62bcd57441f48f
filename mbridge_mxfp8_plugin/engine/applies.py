"""Whether the plugin has anything to do for a job, and who owns its param sync: decided once.

The adapters and the engine used to ask the same three questions each (is every chunk
megatron-core DDP, is the MXFP8 reuse mode on, does Megatron-FSDP or the LayerWise optimizer own
the sync), in two orders. The answer is one :class:`Decision`: an adapter takes it before it
builds the engine, hands it over, and logs what it says. Where the plugin applies, whether the
running loop and core already do all of its work (:func:`loop_does_the_work`) is asked here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..mcore.layout import distributed_optimizers, is_megatron_ddp, reuse_mode_active
from ..probes import CoreBehaviour, probe_live_loop
from ..probes.owners import SyncOwner, sync_owner

__all__ = ["Decision", "decide", "loop_does_the_work"]


@dataclass(frozen=True)
class Decision:
    """The plugin applies (``reason`` None), or why not; ``owner`` when someone else owns the sync."""

    owner: SyncOwner | None = None
    reason: str | None = None

    @property
    def applies(self) -> bool:
        return self.reason is None

    @classmethod
    def owned_by(cls, owner: SyncOwner) -> Decision:
        return cls(owner, f"{owner.owner} owns the param sync ({owner.found})")


def decide(
    model_chunks: Sequence[Any], optimizer: Any | None = None, *, owner: SyncOwner | None = None
) -> Decision:
    """The decision for these chunks and optimizer. ``owner``: one already found for this job
    (Bridge's save hands the unwrapped modules, which no longer show the FSDP wrapper)."""
    owner = owner or sync_owner(model_chunks, optimizer)
    if owner is not None:
        return Decision.owned_by(owner)
    if not all(is_megatron_ddp(m) for m in model_chunks):
        kinds = sorted({type(m).__name__ for m in model_chunks})
        return Decision(
            reason=f"model chunks are {kinds}, not megatron-core DistributedDataParallel "
            "(Megatron-FSDP and torch DDP do not have these defects)"
        )
    if not reuse_mode_active(model_chunks):
        return Decision(
            reason="reuse_grad_buf_for_mxfp8_param_ag is off or the distributed optimizer is not used"
        )
    return Decision()


def loop_does_the_work(behaviour: CoreBehaviour, optimizer: Any | None) -> bool:
    """The running loop stages the main params before every forced sync, and core does the rest.

    True only when all of these hold: megatron-core writes forced gathers back (B1), resets
    the dispatch state (C) and offers ``prepare_model_params_for_param_sync`` (>= 0.19); the
    loaded training loop (Megatron-Bridge >= 0.6, Megatron-LM core_v0.19) calls it before its
    forced syncs; and every distributed optimizer's *own* config has both
    ``reuse_grad_buf_for_mxfp8_param_ag`` and ``overlap_param_gather`` (core 0.19 stages only
    then). Then every engine action would only repeat core's work: the engine is passive.
    """
    if not (
        behaviour.has_prepare_for_param_sync
        and behaviour.forced_sync_writes_back
        and behaviour.has_dispatch_reset
        and probe_live_loop()
        and optimizer is not None
    ):
        return False
    opts = distributed_optimizers(optimizer)
    return bool(opts) and all(
        getattr(o.config, "reuse_grad_buf_for_mxfp8_param_ag", False)
        and getattr(o.config, "overlap_param_gather", False)
        for o in opts
    )
