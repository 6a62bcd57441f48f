"""Run megatron-core's DDP and distributed optimizer on a machine without CUDA.

megatron-core allocates its buffers with ``device=torch.cuda.current_device()``, waits on
CUDA streams and events, and classifies params by ``Tensor.type()`` strings such as
``'torch.cuda.BFloat16Tensor'``. None of that changes *what* the code computes, only *where*,
so on a CPU-only host we redirect the device to ``cpu``, turn stream/event/synchronize into
no-ops and report CPU tensors under their CUDA type names. The collectives themselves run
for real over gloo.

The shim is a reversible context (:func:`cpu_shim`) and is a no-op when CUDA is available:
the GPU tier runs the very same tests without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shim", "shim_needed"]

_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def shim_needed() -> bool:
    """True when CUDA is absent, i.e. when megatron-core needs the shim to run at all."""
    return not torch.cuda.is_available()


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, bool):  # Tensor.to(device, dtype, non_blocking) passes a bool positionally
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every ``device=`` keyword that names CUDA (or a bare CUDA ordinal) to cpu."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            args = tuple(_to_cpu_device(a) for a in args)
            kwargs.pop("non_blocking", None)
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: everything runs on one (CPU) stream already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NullStream:
        return _NullStream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *args: Any) -> float:
        return 0.0

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _fake_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
    if dtype is None:
        name = _ORIGINAL["Tensor.type"](self)
        return _CPU_TYPE_TO_CUDA.get(name, name)
    if isinstance(dtype, str):
        dtype = dtype.replace("torch.cuda.", "torch.")
    return _ORIGINAL["Tensor.type"](self, dtype, non_blocking, **kw)


_ORIGINAL: dict[str, Any] = {}

_CUDA_STUBS: dict[str, Any] = {
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
    "Stream": _NullStream,
    "Event": _NullStream,
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "current_stream": lambda *a, **k: _NullStream(),
    "default_stream": lambda *a, **k: _NullStream(),
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_allocated": lambda *a, **k: 0,
    "reset_peak_memory_stats": lambda *a, **k: None,
}


def _install() -> None:
    _ORIGINAL["Tensor.type"] = torch.Tensor.type
    _ORIGINAL["Tensor.cuda"] = torch.Tensor.cuda
    for name, stub in _CUDA_STUBS.items():
        _ORIGINAL[f"cuda.{name}"] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, stub)
    torch.Tensor.type = _fake_type  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _uninstall() -> None:
    torch.Tensor.type = _ORIGINAL.pop("Tensor.type")  # type: ignore[method-assign]
    torch.Tensor.cuda = _ORIGINAL.pop("Tensor.cuda")  # type: ignore[method-assign]
    for name in _CUDA_STUBS:
        original = _ORIGINAL.pop(f"cuda.{name}")
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)


_depth = 0


@contextlib.contextmanager
def cpu_shim(enabled: bool | None = None) -> Iterator[bool]:
    """Let megatron-core DDP + distributed optimizer run on CPU; yields whether it is active.

    ``enabled=None`` activates it only where CUDA is absent. Re-entrant: nested uses share one
    installation, and leaving the outermost context restores torch exactly.
    """
    global _depth
    active = shim_needed() if enabled is None else enabled
    if not active:
        yield False
        return
    if _depth == 0:
        _install()
    _depth += 1
    mode = _CudaToCpuMode()
    try:
        with mode:
            yield True
    finally:
        _depth -= 1
        if _depth == 0:
            _uninstall()
