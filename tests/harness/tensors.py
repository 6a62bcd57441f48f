"""Tensor types the verifier's tests build where a real one cannot exist here."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StoragelessTensor"]


class StoragelessTensor(torch.Tensor):
    """A wrapper subclass with no storage of its own and no TE buffers (as a quantized param type
    the verifier does not know would be): ``data_ptr`` and every op on it raise."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...]) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(func)
