"""Which tensors, at which addresses, a kept plan reads: taken at every check, so it is built as
cheaply as Python allows.

A plan (``weights``) holds views of the params' codes, scales and values and of the fp32 main
shards, and its captured graph reads them by address. It may be reused only while every one of
them is the same object at the same address: a param whose data moved, a main shard the
optimizer replaced, a quantizer swapped, a new param. The fingerprint lists exactly those facts;
the tensors it addressed are kept beside it, so a later call can compare their addresses alone
before it launches a kept graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ..mcore.layout import bucket_params, buffers, main_params

__all__ = ["DATA_PTR", "fingerprint", "params_of"]


def params_of(chunks: list[Any]) -> list[Any]:
    """Every buffer param in buffer order, as a list (the fingerprint reads it at every check)."""
    return [p for ref in buffers(chunks) for bucket in ref.bucket_list for p in bucket_params(bucket)]


def fingerprint(chunks: list[Any], optimizer: Any, addressed: list[Any] | None = None) -> tuple[Any, ...]:
    """Which tensors, at which addresses, a plan reads: every buffer param (the codes, scales or
    per-tensor FP8 bytes it holds) and every main shard. A plan is reused only while this is
    unchanged, so its views never read memory the params or the optimizer have moved away from.
    Empty where it cannot be taken (nothing is then reused).

    Taken at every check, so it is built as cheaply as Python allows: on one H200 it was most of
    a replayed sampled check's host time (0.3-0.6 ms of 1.0-1.2 ms at 1B, 120 params). The
    tensors are listed first, then addressed in C loops (``map``): the objects, and their first
    elements' pointers (``data_ptr`` includes the storage offset, so a moved view or a swapped
    storage changes it). ``addressed`` receives the tensors whose pointers it took."""
    parts: list[Any] = []
    add = parts.append
    tensors: list[Any] = []
    try:
        # One subclass-dispatch guard for the whole walk: entered per tensor it cost more than
        # the reads.
        with torch._C.DisableTorchFunctionSubclass():
            for param in params_of(chunks):
                kind = type(param)
                add(kind)
                add(param.shape)
                tensors.append(param)
                own = param.__dict__
                if kind in _PLAIN and _ATTRS.isdisjoint(own):
                    tensors.extend(_NO_HELD)  # a plain param holds none of them (no lookups that miss)
                    parts.extend(_NO_LAYOUT)
                    continue
                declared = _DECLARED.get(kind)
                if declared is None:
                    declared = _DECLARED[kind] = _declared(kind)
                if declared:  # a property, a slot, a class default, __getattr__: ask getattr
                    tensors.extend(getattr(param, name, None) for name in _HELD_ATTRS)
                    parts.extend(getattr(param, name, None) for name in _LAYOUT_ATTRS)
                else:  # instance attributes only: the dict answers, a miss without an exception
                    tensors.extend(map(own.get, _HELD_ATTRS))
                    parts.extend(map(own.get, _LAYOUT_ATTRS))
            tensors.extend(main_params(optimizer))
            parts.extend(map(id, tensors))
            parts.extend(_pointers(tensors, addressed))
    except (AttributeError, TypeError, RuntimeError):
        return ()
    return tuple(parts)


def _pointers(tensors: list[Any], addressed: list[Any] | None = None) -> list[int]:
    """``data_ptr`` of every tensor with storage, in order (None, and types seen without
    storage, are left out; their objects are in the fingerprint already); those tensors are
    appended to ``addressed``."""
    no_storage = _NO_STORAGE
    if no_storage:
        kept = [t for t in tensors if t is not None and type(t) not in no_storage]
    else:
        kept = [t for t in tensors if t is not None]
    try:
        out = list(map(DATA_PTR, kept))
    except (RuntimeError, NotImplementedError, TypeError):  # a storage-less wrapper, a non-tensor
        out, fine = [], []
        for tensor in kept:
            try:
                out.append(DATA_PTR(tensor))
                fine.append(tensor)
            except (RuntimeError, NotImplementedError, TypeError):
                if isinstance(tensor, torch.Tensor) and type(tensor) not in _PLAIN:
                    no_storage.add(type(tensor))
        kept = fine
    if addressed is not None:
        addressed.extend(kept)
    return out


_LAYOUT_ATTRS = ("_fp8_dtype", "_with_gemm_swizzled_scales", "_quantizer")
#: The tensors a quantized param holds that the check reads or folds (``read``, ``replica``).
_HELD_ATTRS = ("_rowwise_data", "_rowwise_scale_inv", "_data", "_scale_inv")


#: Param types that hold values only: none of the attributes above unless set on the instance.
_PLAIN = (torch.nn.Parameter, torch.Tensor)
_ATTRS = frozenset(_HELD_ATTRS + _LAYOUT_ATTRS)
#: What a param without those attributes lists for them.
_NO_HELD: tuple[None, ...] = (None,) * len(_HELD_ATTRS)
_NO_LAYOUT: tuple[None, ...] = (None,) * len(_LAYOUT_ATTRS)
DATA_PTR = torch.Tensor.data_ptr
#: Per param type, which of those names its class declares (a property, a slot, a class default),
#: or all of them where it resolves names itself (``__getattr__``).
_DECLARED: dict[type, frozenset[str]] = {}


def _declared(kind: type) -> frozenset[str]:
    if any("__getattr__" in vars(k) for k in kind.__mro__ if k is not object):
        return _ATTRS
    return frozenset(n for n in _ATTRS if any(n in vars(k) for k in kind.__mro__))


#: Tensor subclasses seen without storage (wrapper subclasses): addressed by object alone, so
#: their ``data_ptr`` is not asked (and refused) again at every check.
_NO_STORAGE: set[type] = set()
