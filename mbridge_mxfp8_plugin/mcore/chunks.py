"""Where the megatron-core model chunks are, behind whatever wrapper the caller holds.

Users hand the verifier, ``ensure_weights_current`` and the Lightning adapter what their
framework gives them: a list of chunks, NeMo's ``MegatronParallel``, a Lightning module, a
``Float16Module``. Each needs the megatron-core ``DistributedDataParallel`` chunks underneath
(their buffers, buckets and data-parallel groups), so the search lives here once, below both the
engine's users and the read-only check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import MXFP8UsageError
from .layout import is_megatron_ddp, is_megatron_fsdp

__all__ = ["find_model_chunks", "model_chunks"]

#: How deep the search goes: wrappers nest a few levels (MegatronParallel -> chunk ->
#: Float16Module -> DDP); a deeper walk would only visit layers of the model itself.
_MAX_DEPTH = 6


def find_model_chunks(roots: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """Megatron-core DDP chunks reachable from ``roots``; returns ``(ddp_chunks, fsdp_chunks)``.

    Walks lists and ``ModuleList``-like containers (NeMo's ``MegatronParallel`` is one), ``.module``
    wrapper chains (``Float16Module`` -> DDP) and child modules, but never into a DDP chunk: the
    model inside can be huge and holds nothing we need. Order is preserved, duplicates dropped.
    """
    found: list[Any] = []
    fsdp: list[Any] = []
    seen: set[int] = set()
    # Depth first with a stack of its own, not a recursive closure: a closure that calls itself
    # is a reference cycle, which every check (``verify_weights`` asks at each call) would leave
    # to the cyclic collector, whose pass then lands in a later check.
    stack = [(root, 0) for root in reversed(list(roots))]
    while stack:
        obj, depth = stack.pop()
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        if is_megatron_fsdp(obj):
            fsdp.append(obj)
        elif is_megatron_ddp(obj):
            found.append(obj)
        else:
            stack.extend((inner, depth + 1) for inner in reversed(_inside(obj)))
    return found, fsdp


def _inside(obj: Any) -> list[Any]:
    """What discovery walks into from ``obj``, in order: a list's items, or a wrapper's
    ``.module`` and then its child modules."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    out: list[Any] = []
    inner = getattr(obj, "module", None) if not isinstance(obj, type) else None
    if inner is not None:
        out.append(inner)
    children = getattr(obj, "children", None)
    if callable(children):
        try:
            out += list(children())
        except TypeError:  # not a module's ``children``: nothing inside
            pass
    return out


def model_chunks(held: Sequence[Any] | Any) -> list[Any]:
    """The megatron-core DDP chunks behind ``held``; a usage error when there are none."""
    found, _ = find_model_chunks([held])
    if not found:
        raise MXFP8UsageError(
            "verify_weights / ensure_weights_current need megatron-core DistributedDataParallel model "
            f"chunks; found none in {type(held).__name__}"
        )
    return found
