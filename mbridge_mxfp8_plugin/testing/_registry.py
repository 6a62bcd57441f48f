"""How the kit's emulated MXFP8 types become the ones megatron-core recognises.

megatron-core never imports Transformer Engine's tensor classes directly where it asks "is this
param quantized / MXFP8?": ``fp8_utils.is_float8tensor`` and ``is_mxfp8tensor`` read module globals
at call time. Swapping those globals (and restoring them) therefore reaches every module that
imported the functions, which is what lets an emulation run core's own MXFP8 code paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["registered_in_fp8_utils"]

_GLOBALS = ("HAVE_TE_FP8_TENSOR_CLASS", "FP8_TENSOR_CLASS", "HAVE_TE_MXFP8TENSOR", "MXFP8Tensor")


@contextlib.contextmanager
def registered_in_fp8_utils(quantized_base: type, mxfp8_type: type) -> Iterator[None]:
    """``quantized_base`` stands in for TE's ``QuantizedTensor``, ``mxfp8_type`` for its
    ``MXFP8Tensor``, until the context exits (then core sees what it saw before)."""
    from megatron.core import fp8_utils

    saved: dict[str, Any] = {name: getattr(fp8_utils, name, None) for name in _GLOBALS}
    fp8_utils.HAVE_TE_FP8_TENSOR_CLASS = True
    fp8_utils.FP8_TENSOR_CLASS = quantized_base
    fp8_utils.HAVE_TE_MXFP8TENSOR = True
    fp8_utils.MXFP8Tensor = mxfp8_type
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(fp8_utils, name, value)
