"""How the check reads a param's MXFP8 blocks without copying the param.

Two storage shapes exist. A param that holds its values (plain bf16, the test kit's emulation)
is read in place through its storage. A param that holds codes and scales, as Transformer
Engine's ``MXFP8Tensor`` does (``_rowwise_data``: one E4M3/E5M2 byte per element;
``_rowwise_scale_inv``: one E8M0 byte per 32-element block of a row, possibly padded to 128 x 4
tiles), is read by decoding only the sampled blocks: the code times ``2**(e - 127)``, then
rounded to the param's dtype as the type's own ``dequantize`` rounds. A whole-param
``dequantize()`` would cost a bf16 copy of the model. Whether a reader decodes a type the way the
type does is checked on a small instance of that type (see ``reference``), so a layout read
wrongly makes params ``unchecked``, never ``WRONG``.

:class:`Blocks` is the sampled geometry: every ``step``-th 32-element block of a row, as
``(k, 32)`` views of any flat source laid out like the param (values, codes, the main shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..common.mxfp8_cast import MXFP8_BLOCK as BLOCK

__all__ = ["BLOCK", "Blocks", "Reader", "decode", "gather_ragged", "reader_for"]

_FP8_FORMATS = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
_FP32_MANT_BITS = 23
_BF16_MANT_BITS = 7


@dataclass(frozen=True)
class Blocks:
    """``count`` sampled blocks, ``step`` apart, from global block ``start`` (``row * per_row +
    column``) of a param with rows of ``last`` elements; or, with ``origin`` set, runs of 32
    elements counted from flat element ``origin`` (bf16 params: no scale, any grouping works)."""

    last: int
    start: int
    count: int
    step: int
    origin: int = 0

    @property
    def per_row(self) -> int:
        return -(-self.last // BLOCK)

    @property
    def aligned(self) -> bool:
        return self.last % BLOCK == 0

    @property
    def is_view(self) -> bool:
        """Whether ``take`` is a view (kept by a plan) rather than a gather (taken anew)."""
        return self.aligned

    def part(self, lo: int, count: int) -> Blocks:
        return Blocks(self.last, self.start + lo * self.step, count, self.step, self.origin)

    def at(self, value: int) -> Blocks:
        """These blocks at sampled phase ``value``: the same (one phase; see ``sampling.Phased``)."""
        return self

    def elements(self) -> int:
        """Real elements in these blocks (a row's last block of a ragged row is shorter)."""
        if self.aligned:
            return self.count * BLOCK
        ids = self.start + self.step * torch.arange(self.count)
        return int((self.last - (ids % self.per_row) * BLOCK).clamp(max=BLOCK).sum())

    def take(self, flat: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The blocks of ``flat`` (element ``i`` of the param at ``flat[base + i]``) as
        ``(count, 32)``: a strided view when rows are whole blocks, else a zero-padded gather
        (zeros leave a block's amax, so its scale, unchanged)."""
        if self.aligned:
            at = flat.storage_offset() + base + self.origin + self.start * BLOCK
            return flat.as_strided((self.count, BLOCK), (self.step * BLOCK, 1), at)
        ids = self.start + self.step * torch.arange(self.count, device=flat.device)
        return gather_ragged(flat, base, ids, self.last)

    def take_scales(self, scales: torch.Tensor, cols: int) -> torch.Tensor:
        """The E8M0 byte of each block, from scales stored ``cols`` to a row."""
        if cols == self.per_row:
            return scales.as_strided((self.count,), (self.step,), scales.storage_offset() + self.start)
        ids = self.start + self.step * torch.arange(self.count, device=scales.device)
        return scales[(ids // self.per_row) * cols + ids % self.per_row]

    def kernel_args(self) -> tuple[int, int, int, int, int, int]:
        """What the fused kernel reads this geometry from (``Phased.kernel_args``): one phase,
        so the first block is ``start`` whatever the phase tensor holds."""
        return self.start, 0, self.count, self.count * self.step, 1, self.step


def gather_ragged(flat: torch.Tensor, base: int, ids: torch.Tensor, last: int) -> torch.Tensor:
    """Blocks ``ids`` (global block ids, a device tensor) of rows of ``last`` elements, ``last % 32
    != 0``, as ``(len(ids), 32)`` gathered from ``flat`` (element ``i`` at ``flat[base + i]``),
    zero-padded past each row's end (zeros leave a block's amax, so its scale, unchanged)."""
    per_row = -(-last // BLOCK)
    rows, cols = ids // per_row, ids % per_row
    starts = rows * last + cols * BLOCK
    lanes = torch.arange(BLOCK, device=ids.device)
    inside = lanes < (last - cols * BLOCK).clamp(max=BLOCK).unsqueeze(1)
    # Lanes past a row's end point at the block's first element: always inside the shard.
    index = torch.where(inside, starts.unsqueeze(1) + lanes, starts.unsqueeze(1))
    zero = torch.zeros((), dtype=flat.dtype, device=flat.device)
    return torch.where(inside, flat[index + base], zero)


@dataclass(frozen=True)
class Reader:
    """Where a tensor's blocks are: its values, or its codes with their scales."""

    flat: torch.Tensor  # values in the param's dtype, or codes (uint8), over the param's elements
    scales: torch.Tensor | None = None  # E8M0 bytes, flat
    scale_cols: int = 0  # scale bytes per row of ``scales``
    element: torch.dtype | None = None  # the codes' FP8 format

    @property
    def kind(self) -> str:
        return "values" if self.scales is None else f"codes ({str(self.element).split('.')[-1]})"

    def values(self, blocks: Blocks, dtype: torch.dtype, base: int = 0) -> torch.Tensor:
        """The blocks' values in ``dtype`` (decoded from the codes where there are codes)."""
        got = blocks.take(self.flat, base)
        if self.scales is None:
            return got
        return decode(got, blocks.take_scales(self.scales, self.scale_cols), self.element, dtype)


def _element(fmt: Any) -> torch.dtype | None:
    if isinstance(fmt, torch.dtype):
        return fmt if fmt in _FP8_FORMATS.values() else None
    name = str(getattr(fmt, "name", fmt))
    return next((dtype for suffix, dtype in _FP8_FORMATS.items() if name.endswith(suffix)), None)


def reader_for(tensor: Any) -> Reader | str:
    """How to read ``tensor``'s blocks, or why they cannot be read (then it is ``unchecked``)."""
    if hasattr(tensor, "_rowwise_data"):
        return _codes_reader(tensor)
    if hasattr(tensor, "_data"):
        return "per-tensor FP8 storage (_data): no MXFP8 blocks to read"
    with torch._C.DisableTorchFunctionSubclass():
        try:  # a wrapper subclass has a nominal storage whose data pointer cannot be read
            storage = torch.Tensor.untyped_storage(tensor)
            storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            storage = None
        if storage is None or storage.nbytes() < tensor.numel() * tensor.element_size():
            return (
                f"{type(tensor).__name__} keeps neither its values in its storage nor rowwise codes "
                "and scales (_rowwise_data, _rowwise_scale_inv)"
            )
        # A plain tensor over the storage: the views below skip the subclass's __torch_function__
        # (its Python cost per view is most of a sampled check's host time).
        return Reader(torch.Tensor.reshape(tensor.detach(), -1))


def _codes_reader(tensor: Any) -> Reader | str:
    data, scales = tensor._rowwise_data, getattr(tensor, "_rowwise_scale_inv", None)
    name = type(tensor).__name__
    if not isinstance(data, torch.Tensor) or not isinstance(scales, torch.Tensor):
        return f"{name} holds no rowwise codes and scales (column-wise only)"
    if data.dtype != torch.uint8 or data.numel() != tensor.numel() or not data.is_contiguous():
        return f"{name}'s rowwise codes are not one contiguous byte per element"
    if getattr(tensor, "_with_gemm_swizzled_scales", False):
        return f"{name}'s scales are swizzled for the GEMM (layout not read here)"
    element = _element(getattr(tensor, "_fp8_dtype", None))
    if element is None:
        return f"{name}'s element format {getattr(tensor, '_fp8_dtype', None)!r} is not E4M3 or E5M2"
    last = tensor.shape[-1] if tensor.dim() else 1
    rows, per_row = tensor.numel() // max(last, 1), -(-last // BLOCK)
    if scales.dtype != torch.uint8 or not scales.is_contiguous():
        return f"{name}'s scales are not contiguous E8M0 bytes"
    if scales.dim() == 2 and scales.shape[0] >= rows and scales.shape[1] >= per_row:
        cols = scales.shape[1]
    elif scales.numel() == rows * per_row:
        cols = per_row
    else:
        return f"{name}'s scales {tuple(scales.shape)} do not cover {rows} rows x {per_row} blocks"
    return Reader(data.reshape(-1), scales.reshape(-1), cols, element)


def decode(codes: torch.Tensor, exponents: torch.Tensor, element: Any, dtype: torch.dtype) -> torch.Tensor:
    """MXFP8 values of ``(k, 32)`` code bytes with one biased E8M0 byte per row, in ``dtype``:
    ``code * 2**(e - 127)`` in fp32 (exact), then one rounding to ``dtype``. The scale is built
    from its bits as TE's dequantization builds it (``e << 23``: 0 for ``e == 0``, which only an
    all-zero or flushed block has under TE's rule); the self-check against a type's own
    ``dequantize`` catches a type that decodes otherwise."""
    if dtype == torch.bfloat16:
        # bf16 has fp32's exponent range: the scale is exact, every E4M3/E5M2 code converts
        # exactly, and the product is rounded once from fp32 as below, with a quarter of the bytes.
        scale = (exponents.to(torch.int16).unsqueeze(-1) << _BF16_MANT_BITS).view(torch.bfloat16)
        return codes.view(element).to(torch.bfloat16) * scale
    scale = (exponents.to(torch.int32).unsqueeze(-1) << _FP32_MANT_BITS).view(torch.float32)
    return (codes.view(element).float() * scale).to(dtype)
