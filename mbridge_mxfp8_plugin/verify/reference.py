"""The reference: sampled main-shard blocks quantized by the param type's own write path.

A param sync ends with megatron-core writing the gathered bf16 values into each MXFP8 param, so
what the param must hold is whatever that write makes of the main shard. The check therefore
makes a small instance of the param's own type and configuration, ``(k, 32)`` for ``k`` sampled
blocks (MXFP8 row-wise blocks are independent along the last dimension, so a block quantized
alone gets the scale it gets inside the param), and writes the blocks into it with the very
function the installed megatron-core uses:

* core <= 0.18: ``param.data.copy_(gathered)`` (a TE tensor dispatches it to its ``_quantizer``;
  the test kit's emulation to its own rule);
* core 0.19: ``fp8_utils.copy_tensor_to_quantized_param`` (the same ``copy_`` for a plain
  quantized tensor);
* core main: ``fp8_utils.copy_tensors_to_quantized_params``, which calls
  ``_quantizer.update_quantized`` directly where the param has a quantizer.

Any scale rule a type implements is thus checked by itself: no rule is assumed. A small instance
is made from the param's quantizer (a row-wise copy: ``make_empty``, else ``quantize``) or, for
a type that holds its values, as an empty tensor of that type. Where neither works, the param is
``unchecked`` with the reason: a check that cannot know must not say ``WRONG``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .read import BLOCK, Blocks, reader_for

__all__ = ["Reference", "make_reference", "self_check"]

#: Rows of the probe write per batch key: the self-check and, on a CUDA device, the measured
#: bytes the write allocates per element (which sizes the batches).
PROBE_ROWS = 8192

Write = Callable[[Any, torch.Tensor], None]


def _core_write() -> tuple[Write, str]:
    """The function the installed megatron-core writes gathered values into a quantized param with."""
    from megatron.core import fp8_utils

    batched = getattr(fp8_utils, "copy_tensors_to_quantized_params", None)
    if batched is not None:
        return (lambda dst, src: batched([dst], [src])), "copy_tensors_to_quantized_params"
    single = getattr(fp8_utils, "copy_tensor_to_quantized_param", None)
    if single is not None:
        return single, "copy_tensor_to_quantized_param"

    def copy(dst: Any, src: torch.Tensor) -> None:
        dst.copy_(src.view(dst.shape))

    return copy, "copy_"


class Reference:
    """Makes reference blocks for params of one type and configuration (one per batch key)."""

    def __init__(self, param: Any, write: Write, write_name: str) -> None:
        self.param = param
        self.dtype: torch.dtype = param.dtype
        self.write = write
        self.path = f"{type(param).__name__} via {write_name}"
        self.quantizer = getattr(param, "_quantizer", None)
        if self.quantizer is not None:
            q = self.quantizer.copy() if hasattr(self.quantizer, "copy") else self.quantizer
            if hasattr(q, "set_usage"):
                q.set_usage(rowwise=True, columnwise=False)  # the column-wise copy is not compared
            self.quantizer = q
        self._kept: tuple[tuple[int, int], Any, Any, Any] | None = None

    def _empty(self, shape: tuple[int, int], device: Any) -> Any:
        """A small instance of the param's type and configuration."""
        q = self.quantizer
        if q is not None:
            if hasattr(q, "make_empty"):
                return q.make_empty(shape, dtype=self.dtype, device=device)
            return q.quantize(torch.zeros(shape, dtype=self.dtype, device=device))
        return torch.empty(shape, dtype=self.dtype, device=device).as_subclass(type(self.param))

    def codes(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (``(n, 32)``, ``n`` a multiple of 32, the first ``k`` the blocks compared)
        written into an instance of the type, kept for the next batch of that shape (the write
        overwrites every code and scale of its row-wise copy); returns the codes ``(k, 32)``
        and scale bytes ``(k,)`` as views. Equal bytes mean equal values; the caller compares
        values only where bytes differ."""
        shape = (rows.shape[0], BLOCK)
        if self._kept is None or self._kept[0] != shape:
            self._kept = None  # free the old instance before the new one is made
            self._kept = (shape, self._empty(shape, rows.device), None, None)
        _, small, data, views = self._kept
        self.write(small, rows)
        if views is None or views[0] != k or getattr(small, "_rowwise_data", None) is not data:
            reader = reader_for(small)  # read after the write: a write may rebind the buffers
            if isinstance(reader, str) or reader.scales is None:
                raise TypeError(reader if isinstance(reader, str) else "the small instance holds no codes")
            scales = reader.scales.view(-1, reader.scale_cols)[:k, 0]
            views = (k, reader.flat.view(shape)[:k], scales)
            self._kept = (shape, small, getattr(small, "_rowwise_data", None), views)
        return views[1], views[2]

    def release(self) -> None:
        self._kept = None

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``rows`` (``(k, 32)`` blocks of the main shard, already rounded as the gather moves
        them) written into a fresh small instance; returns its values in the param's dtype and
        the instance. Rows are padded to whole 32-row tiles (TE quantizes whole tiles; zero rows
        are blocks of their own and change no other row)."""
        k = rows.shape[0]
        pad = (-k) % BLOCK
        # Written as the gather delivers them: bf16 in reuse mode; fp32 where core casts the main
        # shard into a uint8 buffer itself (no bf16 rounding first).
        src = rows
        if pad:
            src = torch.nn.functional.pad(src, (0, 0, 0, pad))
        small = self._empty((k + pad, BLOCK), src.device)
        self.write(small, src)
        if hasattr(small, "dequantize"):
            values = small.dequantize()
        else:
            reader = reader_for(small)
            if isinstance(reader, str):
                raise TypeError(reader)
            values = reader.flat.view(k + pad, BLOCK)
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.to(values, self.dtype)[:k], small


def make_reference(param: Any) -> Reference:
    write, name = _core_write()
    return Reference(param, write, name)


def self_check(reference: Reference, small: Any, want: torch.Tensor) -> str | None:
    """Why this check's reader would misread the type, or None: the reader, applied to the small
    instance, must give exactly what the instance's own ``dequantize`` gave."""
    reader = reader_for(small)
    if isinstance(reader, str):
        return reader
    with torch._C.DisableTorchFunctionSubclass():
        got = reader.values(Blocks(last=BLOCK, start=0, count=want.shape[0], step=1), reference.dtype)
        same = got.shape == want.shape and torch.equal(torch.Tensor.to(got, reference.dtype), want)
    if not same:
        return (
            f"{type(small).__name__}'s {reader.kind} do not decode to its own dequantize() on a "
            "small instance (layout not understood)"
        )
    return None
