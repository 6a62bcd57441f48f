"""Which tensors, at which addresses, a kept plan reads: checked at every check, so it is built
and compared as cheaply as Python allows.

A plan (``weights``) holds views of the params' codes, scales and values and of the fp32 main
shards, and its captured graph reads them by address. It may be reused only while every one of
them is the same object at the same address: a param whose data moved, a main shard the
optimizer replaced, a quantizer swapped, a new param. The fingerprint lists exactly those facts.

It keeps the objects it read them from, so a later check asks first whether each is still the
very same object (``unchanged``: identity, compared in C loops, no value built or compared) and
takes a new fingerprint only where one is not. A check after an eval transition finds the job's
objects out of the CPU's caches, and what it reads per param is what it pays (issue 32: most of a
replayed 1/16 check's time at 1B).
"""

from __future__ import annotations

from functools import partial
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any

import torch

from ..mcore.layout import bucket_params, buffers, main_params

__all__ = ["DATA_PTR", "Fingerprint", "fingerprint", "params_of", "unchanged"]


def params_of(chunks: list[Any]) -> list[Any]:
    """Every buffer param in buffer order, as a list (the fingerprint reads it at every check)."""
    return [p for ref in buffers(chunks) for bucket in ref.bucket_list for p in bucket_params(bucket)]


class Fingerprint:
    """A layout as a plan found it: ``parts``, the facts compared when a new one is taken (types,
    shapes, layout attributes by value, tensors by object, addresses), and the objects they were
    read from, which :func:`unchanged` compares by identity. Empty (false) where it could not be
    taken: nothing is then reused."""

    __slots__ = (
        "addressed",
        "asked",
        "asked_values",
        "by_dict",
        "dict_values",
        "present",
        "kinds",
        "mains",
        "params",
        "parts",
        "pointers",
        "shapes",
    )

    def __init__(self) -> None:
        self.parts: tuple[Any, ...] = ()
        self.params: list[Any] = []
        self.kinds: list[type] = []
        self.shapes: list[Any] = []
        #: params whose attributes live in their instance dict, and per name of :data:`_NAMES`
        #: what each held; ``asked``: params of types that declare them (read through getattr)
        self.by_dict: list[Any] = []
        self.dict_values: list[list[Any]] = []
        self.asked: list[Any] = []
        self.asked_values: list[list[Any]] = []
        #: every attribute a param had (held tensors, layout facts), by the names it had: groups
        #: of (params, {name: their values}), for params read through their dict (TE's types)
        #: and those asked through getattr
        self.present: tuple[list[_Group], list[_Group]] = ([], [])
        self.mains: list[Any] = []
        #: the tensors a plan reads by address, and those addresses: a kept graph's launch guard
        self.addressed: list[Any] = []
        self.pointers: list[int] = []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.parts == other.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def __bool__(self) -> bool:
        return bool(self.parts)


def fingerprint(chunks: list[Any], optimizer: Any) -> Fingerprint:
    """Which tensors, at which addresses, a plan reads: every buffer param (the codes, scales or
    per-tensor FP8 bytes it holds) and every main shard. A plan is reused only while this is
    unchanged, so its views never read memory the params or the optimizer have moved away from.

    The tensors are listed first, then addressed in C loops (``map``): the objects, and their
    first elements' pointers (``data_ptr`` includes the storage offset, so a moved view or a
    swapped storage changes it)."""
    taken = Fingerprint()
    try:
        # One subclass-dispatch guard for the whole walk: entered per tensor it cost more than
        # the reads. Each fact is read for every param in one C loop (``map``), not a Python
        # loop per param.
        with torch._C.DisableTorchFunctionSubclass():
            params = taken.params = params_of(chunks)
            kinds = taken.kinds = list(map(type, params))
            taken.shapes = list(map(_SHAPE, params))
            declared = {k for k in set(kinds) if _declared_of(k)}
            by_dict = taken.by_dict = (
                [p for p, k in zip(params, kinds, strict=True) if k not in declared] if declared else params
            )
            dicts: list[dict[str, Any]] = list(map(vars, by_dict))  # type: ignore[arg-type]
            taken.dict_values = [list(map(dict.get, dicts, repeat(name))) for name in _NAMES]
            if declared:  # a property, a slot, a class default, __getattr__: ask getattr
                asked = taken.asked = [p for p, k in zip(params, kinds, strict=True) if k in declared]
                taken.asked_values = [list(map(_GETATTR, asked, repeat(n), repeat(None))) for n in _NAMES]
            taken.present = (
                _present(by_dict, taken.dict_values),
                _present(taken.asked, taken.asked_values) if declared else [],
            )
            taken.mains = main_params(optimizer)
            tensors: list[Any] = list(params)
            for values in (taken.dict_values, taken.asked_values):
                for held in values[: len(_HELD_ATTRS)]:
                    tensors.extend(held)
            tensors.extend(taken.mains)
            taken.pointers = _pointers(tensors, taken.addressed)
            parts: list[Any] = [*kinds, *taken.shapes]
            for values in (taken.dict_values, taken.asked_values):
                for layout in values[len(_HELD_ATTRS) :]:
                    parts.extend(layout)
            parts.extend(map(id, tensors))
            parts.extend(taken.pointers)
            taken.parts = tuple(parts)
    except (AttributeError, TypeError, RuntimeError):
        return Fingerprint()
    return taken


def unchanged(
    kept: Fingerprint,
    chunks: list[Any],
    optimizer: Any,
    part: tuple[int, int] = (0, 1),
    addresses_read: bool = False,
) -> bool:
    """Whether the layout is still ``kept``'s, object for object, with every address the same
    (``addresses_read``: the caller compared them just now). True only where a new fingerprint
    would equal ``kept``, as far as it looked; False where anything differs, even an equal value
    in a new object (the caller then takes a new one, which decides).

    At every call it re-reads whole what the plan reads and how it reads it: which params and
    main shards there are, every address, and every attribute each param had (the tensors it
    holds, its quantizer, element format and scale layout). ``part`` ``(phase, stride)``
    re-reads what no framework changes on a live param (its class, its shape, an attribute it
    did not have) for every ``stride``-th param from ``phase`` only: a sampled check passes its
    rotation here, so each is re-read within ``stride`` calls.

    Every comparison is of identities in a C loop (``operator.is_``), so nothing is built per
    param but the few lists read, and no object's value is asked (a tensor compared by value
    would compare its elements)."""
    if not kept.parts:
        return False
    phase, stride = part
    try:
        with torch._C.DisableTorchFunctionSubclass():
            params = params_of(chunks)
            if len(params) != len(kept.params) or not all(map(is_, params, kept.params)):
                return False
            mains = main_params(optimizer)
            if len(mains) != len(kept.mains) or not all(map(is_, mains, kept.mains)):
                return False
            if not addresses_read and list(map(DATA_PTR, kept.addressed)) != kept.pointers:
                return False
            if stride > 1:
                by_dict, asked = kept.present
                for owners, had in by_dict:
                    dicts: list[dict[str, Any]] = list(map(vars, owners))
                    for name, values in had.items():
                        if not all(map(is_, map(dict.get, dicts, repeat(name)), values)):
                            return False
                for owners, had in asked:
                    for name, values in had.items():
                        if not all(map(is_, map(_GETATTR, owners, repeat(name), repeat(None)), values)):
                            return False
                params = params[phase::stride]
            if not all(map(is_, map(type, params), kept.kinds[phase::stride])):
                return False
            if list(map(_SHAPE, params)) != kept.shapes[phase::stride]:
                return False
            dicts = list(map(vars, kept.by_dict[phase::stride]))
            for name, held in zip(_NAMES, kept.dict_values, strict=True):
                if not all(map(is_, map(dict.get, dicts, repeat(name)), held[phase::stride])):
                    return False
            if kept.asked:
                declared = kept.asked[phase::stride]
                for name, held in zip(_NAMES, kept.asked_values, strict=True):
                    now = map(_GETATTR, declared, repeat(name), repeat(None))
                    if not all(map(is_, now, held[phase::stride])):
                        return False
            return True
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return False


#: Params that had the same attributes, and per name what each held.
_Group = tuple[list[Any], dict[str, list[Any]]]


def _present(owners: list[Any], values: list[list[Any]]) -> list[_Group]:
    """``owners`` grouped by which attributes of :data:`_NAMES` they had (``values``: per name,
    None where absent), with those values: a group's dicts are read once per call, then each
    name in one C loop. Owners that had none are left out."""
    groups: dict[tuple[str, ...], _Group] = {}
    for i, owner in enumerate(owners):
        had = tuple(name for name, held in zip(_NAMES, values, strict=True) if held[i] is not None)
        if had:
            group = groups.setdefault(had, ([], {name: [] for name in had}))
            group[0].append(owner)
            for name in had:
                group[1][name].append(values[_NAMES.index(name)][i])
    return list(groups.values())


def _pointers(tensors: list[Any], addressed: list[Any]) -> list[int]:
    """``data_ptr`` of every tensor with storage, in order (None, types seen without storage,
    and tensors at address 0 (a wrapper that reports no data, an empty tensor: nothing is read
    through them) are left out; their objects are in the fingerprint already); those tensors
    are appended to ``addressed``, which a kept graph's launch guard reads at every call."""
    no_storage = _NO_STORAGE
    kept = list(filter(_NOT_NONE, tensors))
    if no_storage:
        kept = [t for t in kept if type(t) not in no_storage]
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
    if 0 in out:
        kept = [t for t, ptr in zip(kept, out, strict=True) if ptr]
        out = [ptr for ptr in out if ptr]
    addressed.extend(kept)
    return out


_LAYOUT_ATTRS = ("_fp8_dtype", "_with_gemm_swizzled_scales", "_quantizer")
#: The tensors a quantized param holds that the check reads or folds (``read``, ``replica``).
_HELD_ATTRS = ("_rowwise_data", "_rowwise_scale_inv", "_data", "_scale_inv")
#: Every attribute read per param: the held tensors first, then the layout's facts.
_NAMES = _HELD_ATTRS + _LAYOUT_ATTRS


#: Plain tensor types: a ``data_ptr`` they refuse is not taken for a storage-less wrapper type.
_PLAIN = (torch.nn.Parameter, torch.Tensor)
_ATTRS = frozenset(_HELD_ATTRS + _LAYOUT_ATTRS)
DATA_PTR = torch.Tensor.data_ptr
_SHAPE = attrgetter("shape")
_GETATTR = getattr
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
