"""Param syncs that belong to someone else: Megatron-FSDP and the LayerWise (Muon) optimizer.

The plugin's fixes are about one path: megatron-core ``DistributedDataParallel`` buckets whose
param buffer is the grad buffer (``reuse_grad_buf_for_mxfp8_param_ag``), refilled from the
``DistributedOptimizer``'s fp32 shards. Two other owners gather params their own way:

* **Megatron-FSDP** (``megatron.core.distributed.fsdp``; megatron-core's torch-FSDP2 wrapper
  too) has no such buffers. Megatron-Bridge and Megatron-LM switch reuse off under it, and on
  Megatron-LM main it carries MXFP8 weights through its own gather (#7114).
* **LayerWiseDistributedOptimizer** (core >= 0.16; Muon and other emerging optimizers) owns
  whole params per rank and, from core 0.18, gathers the DDP buckets it manages itself
  (``start_param_sync_for_bucket_group_subset``); MXFP8 support for it is being added on
  Megatron-LM main (#6754) with its own open staging problem (#7392).

Staging ``DistributedOptimizer`` shards into those buffers, or forcing their all-gathers, would
write into a sync the plugin does not understand, so the plugin stays passive there and says so.
Detection uses megatron-core's real classes (``isinstance``), plus the attributes core itself
sets (``ddp_config.use_megatron_fsdp``; ``is_managed_by_layer_wise_optimizer`` on params, the
LayerWise bucket lists) for wrappers that forward attribute lookups (NeMo) and for chunks seen
before their optimizer. :func:`probe_owner_files` answers which owners the installed
megatron-core ships, from its files, for ``doctor``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..common.records import record
from ._source import block, megatron_subdir, read_text

__all__ = [
    "LAYER_WISE",
    "MEGATRON_FSDP",
    "OwnerFiles",
    "SyncOwner",
    "fsdp_classes",
    "layer_wise_classes",
    "model_sync_owner",
    "optimizer_sync_owner",
    "probe_owner_files",
    "sync_owner",
]

MEGATRON_FSDP = "Megatron-FSDP"
LAYER_WISE = "the LayerWise distributed optimizer"
_WHY = {
    MEGATRON_FSDP: "it gathers (MXFP8) params itself and has no shared param/grad buffer "
    "(reuse_grad_buf_for_mxfp8_param_ag does not apply to it)",
    LAYER_WISE: "it owns whole params per rank and gathers the buckets it manages itself "
    "(Muon and other emerging optimizers)",
}


@record
class SyncOwner:
    """Who owns the param sync of a job the plugin must leave alone, and why."""

    #: ``"Megatron-FSDP"`` or ``"the LayerWise distributed optimizer"``
    owner: str
    #: the class that was found (qualified name), or the attribute that said so
    found: str
    #: why the plugin must stay out of its way (filled from the owner)
    why: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "why", _WHY[self.owner])

    def message(self) -> str:
        """The one line every entry point logs (rank zero) when it stays passive."""
        return (
            f"MXFP8 param-sync plugin passive: {self.owner} owns the param sync ({self.found}); "
            f"{self.why}. The plugin stages nothing, gathers nothing and writes no weights in this job."
        )


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=1)
def fsdp_classes() -> tuple[type, ...]:
    """megatron-core's FSDP wrapper classes (Megatron-FSDP v1/v2, torch FSDP2); empty without core.

    On Megatron-LM main ``FullyShardedDataParallel`` is a factory function returning a V1 or V2
    class, so every class of the adapter module named ``FullyShardedDataParallel*`` counts.
    """
    found: list[type] = []
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    except Exception:  # noqa: BLE001 - absent, or an optional dependency missing: no such class
        mcore_fsdp_adapter = None
    if mcore_fsdp_adapter is not None:
        found += [
            v
            for k, v in vars(mcore_fsdp_adapter).items()
            if isinstance(v, type) and k.startswith("FullyShardedDataParallel")
        ]
    try:
        from megatron.core.distributed import TorchFullyShardedDataParallel
    except Exception:  # noqa: BLE001
        pass
    else:
        found.append(TorchFullyShardedDataParallel)
    return tuple(found)


@functools.lru_cache(maxsize=1)
def layer_wise_classes() -> tuple[type, ...]:
    """``LayerWiseDistributedOptimizer`` where the installed megatron-core has it (>= 0.16)."""
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except Exception:  # noqa: BLE001
        return ()
    return (LayerWiseDistributedOptimizer,)


def _wrapped(obj: Any) -> Iterator[Any]:
    """``obj`` and what it wraps through ``.module`` (NeMo's wrappers, Float16Module, ...)."""
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        try:
            obj = vars(obj).get("_modules", {}).get("module") or vars(obj).get("module")
        except TypeError:
            return


def model_sync_owner(model_chunks: Sequence[Any] | None) -> SyncOwner | None:
    """Megatron-FSDP (or torch FSDP2) wrapping any chunk, or LayerWise marks on its buckets."""
    fsdp = fsdp_classes()
    for chunk in model_chunks or ():
        for obj in _wrapped(chunk):
            if fsdp and isinstance(obj, fsdp):
                return SyncOwner(MEGATRON_FSDP, _qualname(obj))
            try:
                own = vars(obj)
            except TypeError:
                continue
            # getattr: NeMo's wrappers forward ddp_config from the wrapped module
            config = getattr(obj, "ddp_config", None)
            if config is not None and getattr(config, "use_megatron_fsdp", False):
                return SyncOwner(MEGATRON_FSDP, f"{type(obj).__name__}.ddp_config.use_megatron_fsdp=True")
            if isinstance(own.get("buffers"), (list, tuple)) and _layer_wise(obj):
                return SyncOwner(LAYER_WISE, "buckets marked as LayerWise-managed by megatron-core")
    return None


def _optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizer and every member of (nested) ``ChainedOptimizer`` s."""
    stack, seen = [optimizer], set()
    while stack:
        opt = stack.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        yield opt
        members = getattr(opt, "chained_optimizers", None)
        if isinstance(members, Iterable):
            stack.extend(members)


def optimizer_sync_owner(optimizer: Any) -> SyncOwner | None:
    """A ``LayerWiseDistributedOptimizer`` anywhere in ``optimizer`` (chained or nested)."""
    classes = layer_wise_classes()
    if not classes or optimizer is None:
        return None
    for opt in _optimizers(optimizer):
        if isinstance(opt, classes):
            return SyncOwner(LAYER_WISE, _qualname(opt))
    return None


def sync_owner(model_chunks: Sequence[Any] | None, optimizer: Any = None) -> SyncOwner | None:
    """Who else owns this job's param sync, or None when it is the DDP path the plugin fixes."""
    return model_sync_owner(model_chunks) or optimizer_sync_owner(optimizer)


@record
class OwnerFiles:
    """Which of those owners the installed megatron-core ships (read from its files)."""

    #: ``distributed/fsdp/mcore_fsdp_adapter.py`` defines a ``FullyShardedDataParallel``
    megatron_fsdp: bool
    #: ``optimizer/layer_wise_optimizer.py`` defines ``LayerWiseDistributedOptimizer``
    layer_wise: bool
    #: LayerWise can gather through the DDP param buffers (core >= 0.18: ``use_buffer_param_sync``)
    layer_wise_on_ddp_buffers: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=4)
def probe_owner_files(core_dir: str | None = None) -> OwnerFiles | None:
    """:class:`OwnerFiles` of the installed megatron-core; None when it is not installed."""
    root = Path(core_dir) if core_dir else megatron_subdir("core", "distributed/param_and_grad_buffer.py")
    if root is None:
        return None
    adapter = read_text(root, "distributed/fsdp/mcore_fsdp_adapter.py")
    layer_wise = block(
        read_text(root, "optimizer/layer_wise_optimizer.py"), "class", "LayerWiseDistributedOptimizer"
    )
    return OwnerFiles(
        megatron_fsdp="FullyShardedDataParallel" in adapter,
        layer_wise=bool(layer_wise),
        layer_wise_on_ddp_buffers="use_buffer_param_sync" in layer_wise,
    )


def _layer_wise(obj: Any) -> bool:
    """Asked of a live object only: ``check`` (no live objects) never pays for ``mcore.layout``."""
    from ..mcore.layout import has_layer_wise_marks

    return has_layer_wise_marks(obj)
