"""How the verifier reads a param's MXFP8 blocks (verify/read.py), one process.

``decode`` is checked on codes whose values follow from the formats (E4M3: bias 7, E5M2: bias 15,
E8M0: ``2**(e - 127)``), not from the function; ``Blocks`` on layouts whose blocks are counted by
hand (a ragged row's last block is short and read zero-padded); ``reader_for`` reads a
value-holding param in place, a TE-shaped one from its codes and padded scales, and refuses what
it cannot read with a reason (so the param is ``unchecked``, never ``WRONG``). Whether a reader
decodes a type as the type does is the reference's self-check (test_reference.py).
"""

from __future__ import annotations

import pytest
import torch
from harness.tensors import StoragelessTensor

from mbridge_mxfp8_plugin.testing.te_mxfp8 import make_te_mxfp8_param
from mbridge_mxfp8_plugin.verify.read import BLOCK, Blocks, Reader, decode, reader_for

pytestmark = pytest.mark.matrix  # the reader's refusals, in every release-pair cell (as before the move)

E4M3_ONE, E4M3_MINUS_ONE, E4M3_384, E5M2_ONE = 0x38, 0xB8, 0x7C, 0x3C  # 384 = 1.5 * 2**8


def _codes(*values: int) -> torch.Tensor:
    row = torch.zeros(BLOCK, dtype=torch.uint8)
    row[: len(values)] = torch.tensor(values, dtype=torch.uint8)
    return row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_scales_each_block_by_its_e8m0_byte(dtype: torch.dtype) -> None:
    codes = torch.stack([_codes(E4M3_ONE, E4M3_MINUS_ONE), _codes(E4M3_384), _codes(E4M3_ONE)])
    exponents = torch.tensor([127, 120, 0], dtype=torch.uint8)  # 2**0, 2**-7, and E8M0's zero byte
    got = decode(codes, exponents, torch.float8_e4m3fn, dtype)
    assert got.dtype == dtype and got.shape == (3, BLOCK)
    assert got[0, :3].tolist() == [1.0, -1.0, 0.0]
    assert got[1, 0].item() == 3.0  # 384 * 2**-7
    assert int(got[2].count_nonzero()) == 0  # byte 0 scales to zero (TE's dequantization)
    e5m2 = decode(
        _codes(E5M2_ONE).view(1, BLOCK), torch.tensor([130], dtype=torch.uint8), torch.float8_e5m2, dtype
    )
    assert e5m2[0, 0].item() == 8.0


def test_decode_rounds_once_to_the_target_dtype() -> None:
    """E4M3's subnormal 3 * 2**-9 at the smallest normal scale 2**-126 is 0.75 * 2**-133: exact in
    fp32, below bf16's smallest subnormal step (2**-133), so bf16 gets that product rounded once."""
    codes, e = _codes(0x03).view(1, BLOCK), torch.tensor([1], dtype=torch.uint8)
    exact = 3 * 2.0**-135
    assert decode(codes, e, torch.float8_e4m3fn, torch.float32)[0, 0].item() == exact
    assert decode(codes, e, torch.float8_e4m3fn, torch.bfloat16)[0, 0].item() == 2.0**-133


def test_blocks_of_ragged_rows_are_short_and_read_zero_padded() -> None:
    """(3, 45): two blocks per row, the second of 13 elements."""
    flat = torch.arange(1, 3 * 45 + 1, dtype=torch.float32)
    every = Blocks(last=45, start=0, count=6, step=1)
    assert every.per_row == 2 and not every.aligned
    assert every.elements() == 3 * 45
    rows = every.take(flat)
    assert rows.shape == (6, BLOCK)
    assert rows[0].tolist() == list(range(1, 33))  # row 0, elements 0..31
    assert rows[1, :13].tolist() == list(range(33, 46)) and int(rows[1, 13:].count_nonzero()) == 0
    assert rows[2, 0].item() == 46  # row 1 starts at element 45
    firsts = Blocks(last=45, start=0, count=3, step=2)  # every second block: each row's first
    assert firsts.elements() == 3 * BLOCK
    assert [int(r[0]) for r in firsts.take(flat)] == [1, 46, 91]
    assert firsts.part(1, 2).take(flat)[0, 0].item() == 46


def test_blocks_of_whole_rows_are_views_that_read_the_current_bits() -> None:
    flat = torch.zeros(2 * 64)
    blocks = Blocks(last=64, start=1, count=2, step=2)  # blocks 1 and 3: each row's second half
    view = blocks.take(flat)
    flat[32:64] = 5.0
    flat[96:] = 7.0
    assert blocks.aligned and view.shape == (2, BLOCK)
    assert view[0].eq(5.0).all() and view[1].eq(7.0).all()
    assert blocks.take(flat, base=-32)[0].eq(0.0).all()  # a shard starting at element 32


def test_scales_padded_to_tiles_are_read_per_block() -> None:
    """TE pads the row-wise scales to (128, 4): 4 bytes per row where a row has 2 blocks."""
    scales = torch.zeros(8, 4, dtype=torch.uint8)
    scales[:3, :2] = torch.tensor([[10, 11], [20, 21], [30, 31]], dtype=torch.uint8)
    blocks = Blocks(last=64, start=1, count=3, step=2)  # block 1 of each of 3 rows
    assert blocks.take_scales(scales.reshape(-1), cols=4).tolist() == [11, 21, 31]
    dense = scales[:3, :2].reshape(-1)
    assert blocks.take_scales(dense, cols=2).tolist() == [11, 21, 31]


def test_a_value_holding_param_is_read_in_place() -> None:
    param = torch.nn.Parameter(torch.randn(4, 64).to(torch.bfloat16))
    reader = reader_for(param)
    assert isinstance(reader, Reader) and reader.kind == "values" and reader.scales is None
    assert reader.flat.data_ptr() == param.data_ptr() and reader.flat.numel() == param.numel()
    blocks = Blocks(last=64, start=0, count=8, step=1)
    assert torch.equal(reader.values(blocks, torch.bfloat16), param.detach().reshape(8, BLOCK))


def test_a_te_shaped_param_is_read_from_its_codes_and_padded_scales() -> None:
    param = make_te_mxfp8_param(torch.randn(64, 96))
    reader = reader_for(param)
    assert isinstance(reader, Reader) and reader.kind == "codes (float8_e4m3fn)"
    assert reader.flat.data_ptr() == param._rowwise_data.data_ptr() and reader.scale_cols == 4
    blocks = Blocks(last=96, start=1, count=40, step=3)
    want = blocks.take(param.dequantize().reshape(-1))
    assert torch.equal(reader.values(blocks, torch.bfloat16), want)


def test_what_has_no_rowwise_blocks_is_refused_with_a_reason() -> None:
    columnwise = make_te_mxfp8_param(torch.randn(64, 64))
    columnwise.update_usage(rowwise_usage=False)
    assert "column-wise only" in str(reader_for(columnwise))
    per_tensor = torch.nn.Parameter(torch.zeros(4, 32))
    per_tensor._data = torch.zeros(4, 32, dtype=torch.uint8)  # type: ignore[attr-defined]
    assert "per-tensor FP8" in str(reader_for(per_tensor))
    other_format = make_te_mxfp8_param(torch.randn(64, 64))
    other_format._fp8_dtype = "kFloat8E8M0"
    assert "is not E4M3 or E5M2" in str(reader_for(other_format))
    e5m2 = make_te_mxfp8_param(torch.randn(64, 64))
    e5m2._fp8_dtype = "kFloat8E5M2"
    assert getattr(reader_for(e5m2), "element", None) == torch.float8_e5m2


# Moved from test_reference.py (unchanged assertions).
def test_swizzled_scales_and_unknown_types_are_refused_with_a_reason() -> None:
    param = make_te_mxfp8_param(torch.randn(64, 96) * 0.05)
    param._with_gemm_swizzled_scales = True
    assert "swizzled" in str(reader_for(param))

    reason = reader_for(StoragelessTensor((4, 32)))
    assert isinstance(reason, str) and "StoragelessTensor" in reason
