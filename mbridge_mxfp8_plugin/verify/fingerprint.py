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

from functools import partial
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any

import torch

from ..mcore.layout import bucket_params, buffers, main_params

__all__ = ["DATA_PTR", "fingerprint", "params_of"]


def params_of(chunks: list[Any]) -> list[Any]:
    """Every buffer param in buffer order, as a list (the fingerprint reads it at every check)."""
    return [p for ref in buffers(chunks) for bucket in ref.bucket_list for p in bucket_params(bucket)]


def fingerprint(
    chunks: list[Any],
    optimizer: Any,
    addressed: list[Any] | None = None,
    known: tuple[list[Any], list[int]] | None = None,
) -> tuple[Any, ...]:
    """Which tensors, at which addresses, a plan reads: every buffer param (the codes, scales or
    per-tensor FP8 bytes it holds) and every main shard. A plan is reused only while this is
    unchanged, so its views never read memory the params or the optimizer have moved away from.
    Empty where it cannot be taken (nothing is then reused).

    Taken at every check, so it is built as cheaply as Python allows: on an H100's host it is
    most of a replayed sampled check's host time (0.27-0.30 ms of 0.44 ms at 1B, 120 params). The
    tensors are listed first, then addressed in C loops (``map``): the objects, and their first
    elements' pointers (``data_ptr`` includes the storage offset, so a moved view or a swapped
    storage changes it). ``addressed`` receives the tensors whose pointers it took; ``known``
    (tensors, their pointers read just before) stands for reading them again where the tensors
    are those very objects."""
    try:
        # One subclass-dispatch guard for the whole walk: entered per tensor it cost more than
        # the reads. Each fact is read for every param in one C loop (``map``), not a Python
        # loop per param (on the tests' CPU 1.1 us a param that way, 0.95 us this way).
        with torch._C.DisableTorchFunctionSubclass():
            params = params_of(chunks)
            kinds = list(map(type, params))
            parts: list[Any] = [*kinds, *map(_SHAPE, params)]
            tensors: list[Any] = list(params)
            declared = {k for k in set(kinds) if _declared_of(k)}
            by_dict = (
                [p for p, k in zip(params, kinds, strict=True) if k not in declared] if declared else params
            )
            dicts: list[dict[str, Any]] = list(map(vars, by_dict))  # type: ignore[arg-type]
            for name in _HELD_ATTRS:
                tensors.extend(map(dict.get, dicts, repeat(name)))
            for name in _LAYOUT_ATTRS:
                parts.extend(map(dict.get, dicts, repeat(name)))
            if declared:  # a property, a slot, a class default, __getattr__: ask getattr
                asked = [p for p, k in zip(params, kinds, strict=True) if k in declared]
                for name in _HELD_ATTRS:
                    tensors.extend(map(getattr, asked, repeat(name), repeat(None)))
                for name in _LAYOUT_ATTRS:
                    parts.extend(map(getattr, asked, repeat(name), repeat(None)))
            tensors.extend(main_params(optimizer))
            parts.extend(map(id, tensors))
            parts.extend(_pointers(tensors, addressed, known))
    except (AttributeError, TypeError, RuntimeError):
        return ()
    return tuple(parts)


def _pointers(
    tensors: list[Any], addressed: list[Any] | None = None, known: tuple[list[Any], list[int]] | None = None
) -> list[int]:
    """``data_ptr`` of every tensor with storage, in order (None, and types seen without
    storage, are left out; their objects are in the fingerprint already); those tensors are
    appended to ``addressed``. Where they are ``known``'s tensors, object for object (compared
    by identity: no tensor is read), ``known``'s pointers are theirs."""
    no_storage = _NO_STORAGE
    kept = list(filter(_NOT_NONE, tensors))
    if no_storage:
        kept = [t for t in kept if type(t) not in no_storage]
    if known is not None and len(kept) == len(known[0]) and all(map(is_, kept, known[0])):
        if addressed is not None:
            addressed.extend(kept)
        return list(known[1])
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


#: Plain tensor types: a ``data_ptr`` they refuse is not taken for a storage-less wrapper type.
_PLAIN = (torch.nn.Parameter, torch.Tensor)
_ATTRS = frozenset(_HELD_ATTRS + _LAYOUT_ATTRS)
DATA_PTR = torch.Tensor.data_ptr
_SHAPE = attrgetter("shape")
_NOT_NONE = partial(is_not, None)
#: Per param type, which of those names its class declares (a property, a slot, a class default),
#: or all of them where it resolves names itself (``__getattr__``).
_DECLARED: dict[type, frozenset[str]] = {}


def _declared_of(kind: type) -> frozenset[str]:
    declared = _DECLARED.get(kind)
    if declared is None:
        declared = _DECLARED[kind] = _declared(kind)
    return declared


def _declared(kind: type) -> frozenset[str]:
    if any("__getattr__" in vars(k) for k in kind.__mro__ if k is not object):
        return _ATTRS
    return frozenset(n for n in _ATTRS if any(n in vars(k) for k in kind.__mro__))


#: Tensor subclasses seen without storage (wrapper subclasses): addressed by object alone, so
#: their ``data_ptr`` is not asked (and refused) again at every check.
_NO_STORAGE: set[type] = set()
