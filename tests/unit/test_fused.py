"""The verifier's fused cast-and-compare kernel (mbridge_mxfp8_plugin/verify/fused.py), run on CPU
tensors in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``).

The oracle is the package's TE-rule cast (``mxfp8_cast``, pinned on crafted blocks against TE's
kernel behaviour in test_emulation.py): the kernel must find no differing byte in what that cast
wrote, count every byte changed afterwards, and see blocks of other rules (the OCP spec's floor
scale, a unit-scale stand-in) as differing, which is what keeps those types on their own write.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness.fused_batches import (
    VALUE_SHAPES,
    Launches,
    fused_items,
    own_batch,
    te_reader,
    values_batch,
    wide,
)

from mbridge_mxfp8_plugin.verify import fused
from mbridge_mxfp8_plugin.verify._crafted import crafted_rows
from mbridge_mxfp8_plugin.verify.probe import differing_bytes
from mbridge_mxfp8_plugin.verify.read import BLOCK, Blocks, Reader

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton was imported before the interpreter was chosen"
)


def _count(main: torch.Tensor, base: int, reader: Reader, blocks: Blocks, rounding: bool) -> int:
    flags = torch.zeros(2, dtype=torch.int32)
    fused.compare(main, base, reader, blocks, rounding, flags, 1, torch.zeros((), dtype=torch.int64))
    assert flags[0] == 0  # only its own counter is written
    return int(flags[1])


def test_available_on_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused.available(torch.device("cpu"))
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0")
    assert not fused.available(torch.device("cpu"))
    monkeypatch.setenv("MXFP8_VERIFY_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused.available(torch.device("cpu"))


def test_the_judge_switch_leaves_the_byte_moving_kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MXFP8_VERIFY_FUSED=0`` stands a type in for one the TE-rule kernel refuses: that type
    still gets the gather and values kernels, so the switch must leave them on (a benchmark of
    the own-write path otherwise measures torch's gathers, which no such job runs)."""
    codes, scales = torch.zeros(64, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)
    main = torch.zeros(64)
    e4m3 = Reader(codes, scales, 2, torch.float8_e4m3fn)
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    assert fused.available(torch.device("cpu"))
    assert not fused.usable(e4m3, torch.bfloat16, main)
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "1")
    assert fused.usable(e4m3, torch.bfloat16, main)


@pytest.mark.parametrize("last", [256, 96, 45])
@pytest.mark.parametrize("rounding", [True, False])
def test_no_differing_byte_where_te_rule_wrote(last: int, rounding: bool) -> None:
    main = wide(24, last, seed=last)
    reader, _, _ = te_reader(main.to(torch.bfloat16) if rounding else main)
    blocks = Blocks(last=last, start=0, count=24 * -(-last // BLOCK), step=1)
    assert _count(main.reshape(-1), 0, reader, blocks, rounding) == 0
    # Without the bf16 rounding the gather applies, the fp32 values cast to other bytes.
    if rounding:
        assert _count(main.reshape(-1), 0, reader, blocks, False) > 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_nan_on_both_sides_is_equal_whatever_its_sign(sign: float) -> None:
    """torch's fp32 -> bf16 conversion may flip a NaN's sign (the CPU one makes 0xFFFF); NaN
    against NaN is no difference, as in the byte compare of the type's own write."""
    main = wide(4, 64, seed=3)
    main[1, 5] = sign * float("nan")
    reader, codes, _ = te_reader(main.to(torch.bfloat16))
    blocks = Blocks(last=64, start=0, count=8, step=1)
    assert _count(main.reshape(-1), 0, reader, blocks, True) == 0
    codes[1 * 64 + 5] = 0x3C  # a number where the main shard has NaN
    assert _count(main.reshape(-1), 0, reader, blocks, True) == 1


def test_crafted_blocks_agree_with_the_te_rule() -> None:
    rows = crafted_rows("cpu")
    assert rows.shape[0] % BLOCK == 0
    assert torch.equal(rows, rows.to(torch.bfloat16).float())  # bf16-exact: rounding changes nothing
    reader, _, _ = te_reader(rows.to(torch.bfloat16))
    assert differing_bytes(rows, reader, round_bf16=True) == 0
    assert differing_bytes(rows, reader, round_bf16=False) == 0


def test_counts_every_changed_code_and_scale_byte() -> None:
    main = wide(16, 128, seed=1)
    reader, codes, scales = te_reader(main.to(torch.bfloat16))
    blocks = Blocks(last=128, start=0, count=16 * 4, step=1)
    codes[[3, 700, 2047]] ^= 0x01
    scales[[5, 60]] += 1
    assert _count(main.reshape(-1), 0, reader, blocks, True) == 5


def test_sampled_blocks_of_a_shard() -> None:
    """Every ``step``-th block from global block ``start`` of a param whose main shard begins at
    element ``s``: the kernel reads ``main[i - s]`` and compares only the sampled blocks."""
    last, rows, s = 96, 40, 3 * 96 + 32
    param = wide(rows, last, seed=7)
    reader, codes, _ = te_reader(param.to(torch.bfloat16))
    shard = param.reshape(-1)[s:].clone()
    per_row = last // BLOCK
    first = s // BLOCK
    blocks = Blocks(last=last, start=first + 2, count=(rows * per_row - first - 2) // 5, step=5)
    assert _count(shard, -s, reader, blocks, True) == 0
    unsampled = (first + 3) * BLOCK
    codes[unsampled] ^= 0x40
    assert _count(shard, -s, reader, blocks, True) == 0
    sampled = (first + 2 + 5 * 4) * BLOCK + 31
    codes[sampled] ^= 0x40
    assert _count(shard, -s, reader, blocks, True) == 1


def _ocp_floor(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX spec's scale: ``floor(log2(amax)) - 8``, elements saturated at 448."""
    blocks = values.float().reshape(-1, BLOCK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    codes = (blocks / torch.exp2(exp)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(-1), (exp + 127).to(torch.uint8).reshape(-1)


def test_other_rules_differ_on_the_crafted_blocks() -> None:
    """What keeps a type with another rule on its own write path: the gate's crafted blocks."""
    rows = crafted_rows("cpu")
    codes, scales = _ocp_floor(rows)
    ocp = Reader(codes, scales, 1, torch.float8_e4m3fn)
    assert differing_bytes(rows, ocp, round_bf16=True) > 0
    unit = rows.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
    stand_in = Reader(unit, torch.full((rows.shape[0],), 127, dtype=torch.uint8), 1, torch.float8_e4m3fn)
    assert differing_bytes(rows, stand_in, round_bf16=True) > 0


def test_usable_only_for_layouts_it_reads() -> None:
    main = torch.zeros(64)
    codes, scales = torch.zeros(64, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)
    e4m3 = Reader(codes, scales, 2, torch.float8_e4m3fn)
    assert fused.usable(e4m3, torch.bfloat16, main) and fused.usable(e4m3, None, main)
    assert not fused.usable(Reader(codes, scales, 2, torch.float8_e5m2), torch.bfloat16, main)
    assert not fused.usable(e4m3, torch.float16, main)
    assert not fused.usable(Reader(main), torch.bfloat16, main)  # values, no codes


@pytest.mark.parametrize("last", [96, 128])
@pytest.mark.parametrize("stride", [3, 16])
def test_the_phase_is_read_from_its_tensor(last: int, stride: int) -> None:
    """Issue 32.1: one launch's geometry (``Phased``) compares, at whatever phase its tensor
    holds, exactly that phase's blocks (``mxfp8_blocks``): block ``g`` of the shard is changed in
    ``g % 7 + 1`` code bytes, and the count at each phase is the sum over that phase's blocks,
    each once (a phase with one block fewer masks the missing one), also split into parts."""
    from mbridge_mxfp8_plugin.verify.sampling import Phase, mxfp8_blocks, sampled_mxfp8

    rows, s = 9, last + 40  # the shard starts mid-row: its first block straddles, skipped
    param = wide(rows, last, seed=stride)
    reader, codes, _ = te_reader(param.to(torch.bfloat16))
    shard = param.reshape(-1)[s:].clone()
    per_row = last // BLOCK
    changed = torch.zeros(rows * per_row, dtype=torch.int64)
    for g in range(rows * per_row):
        changed[g] = g % 7 + 1
        codes[g * BLOCK : g * BLOCK + int(changed[g])] ^= 0x01
    phase = Phase(stride)
    blocks, _ = sampled_mxfp8(param, s, rows * last, phase)
    phase.reserve(torch.device("cpu"), blocks.count)
    tensor = phase.tensor(torch.device("cpu"))
    for offset in range(stride):
        phase.set(offset)
        old, _ = mxfp8_blocks(param, s, rows * last, offset, stride)
        want = int(changed[old.start : old.start + old.count * old.step : old.step].sum())
        assert old.count and _count_at(shard, -s, reader, blocks, tensor) == want, offset
        parts = [blocks.part(lo, min(2, blocks.count - lo)) for lo in range(0, blocks.count, 2)]
        assert sum(_count_at(shard, -s, reader, p, tensor) for p in parts) == want, offset


def _count_at(main: torch.Tensor, base: int, reader: Reader, blocks: Blocks, phase: torch.Tensor) -> int:
    flags = torch.zeros(1, dtype=torch.int32)
    fused.compare(main, base, reader, blocks, True, flags, 0, phase)
    return int(flags[0])


@pytest.mark.parametrize(("rounding", "max_rows"), [(True, None), (False, None), (True, 2)])
def test_a_batch_is_one_launch_with_the_verdicts_of_a_launch_per_item(
    monkeypatch: pytest.MonkeyPatch, rounding: bool, max_rows: int | None
) -> None:
    """Issue 32: a batch's items (other shapes, ragged rows, other shard starts and tensors) are
    compared by one launch whose count at every phase is what one launch per item adds up to;
    a code byte changed in one block of the third item is found at that block's phases only.
    A table longer than a kernel searches (``max_rows``) is a launch per segment, each program
    finding its item in its own (their first programs counted from 0 again)."""
    from mbridge_mxfp8_plugin.verify import _program_rows, _te_rule_kernel
    from mbridge_mxfp8_plugin.verify.sampling import Phase, mxfp8_blocks

    if max_rows is not None:
        monkeypatch.setattr(_program_rows, "MAX_ROWS", max_rows)
    stride = 4
    phase = Phase(stride)
    items, codes = fused_items(stride, phase)
    phase.reserve(torch.device("cpu"), max(it.blocks.count for it in items))
    tensor = phase.tensor(torch.device("cpu"))
    one = fused.launch(items, rounding)
    assert one is not None and one.off_div == 1 and one.last_div == 1
    shapes = [s.items.shape for s in one.segments]
    assert shapes == ([(2, 13)] * 2 + [(1, 13)] if max_rows else [(len(items), len(fused.ITEM_FIELDS))])
    assert [int(s.items[0, 3]) for s in one.segments] == [0] * len(shapes)  # 13 fields: what it reads
    third = items[3]  # the third param (the first is two items)

    def sampled(offset: int) -> set[int]:  # the third param's sampled block ids at a phase
        blocks, _ = mxfp8_blocks(torch.empty(14, 96), third.start, 14 * 96, offset, stride)
        return set(range(blocks.start, blocks.start + blocks.count * stride, stride))

    g = sorted(sampled(2))[3]
    assert [g in sampled(o) for o in range(stride)] == [False, False, True, False]
    codes[2][(g // 3) * 96 + (g % 3) * BLOCK + 5] ^= 0x08  # rows of 96: 3 blocks a row
    items_kernel = Launches(_te_rule_kernel.items_kernel)
    per_item = Launches(_te_rule_kernel.kernel)
    monkeypatch.setattr(_te_rule_kernel, "items_kernel", items_kernel)
    monkeypatch.setattr(_te_rule_kernel, "kernel", per_item)
    for offset in range(stride):
        phase.set(offset)
        flags = torch.zeros(3, dtype=torch.int32)
        one(flags, 1, tensor)
        assert flags[0] == 0 and flags[2] == 0  # only its own counter is written
        each = torch.zeros(1, dtype=torch.int32)
        for it in items:
            fused.compare(it.main, -it.start, it.reader, it.blocks, rounding, each, 0, tensor)
        assert int(flags[1]) == int(each[0]), offset
        if rounding:  # what TE's rule wrote: only the changed byte differs, at its phase
            assert int(flags[1]) == (offset == 2), offset
    assert items_kernel.count == stride * len(shapes)  # one launch per batch and phase ...
    assert per_item.count == stride * len(items)  # ... where a launch per item made five


def test_a_batch_of_whole_block_rows_keeps_its_alignment_hints() -> None:
    """Where every row is whole blocks and every offset a multiple of 16 elements, the launch
    reads blocks as the per-item kernel does (vector loads): the counts stay those of per item."""
    from mbridge_mxfp8_plugin.verify.batches import Item

    items = []
    for slot, rows in enumerate((8, 5, 3)):
        param = wide(rows, 128, seed=slot)
        reader, codes, scales = te_reader(param.to(torch.bfloat16))
        codes[128 + slot * 37] ^= 0x02  # past the first row, which the shard does not hold
        scales[4 + slot] += slot  # the first param's is unchanged
        blocks = Blocks(last=128, start=4, count=rows * 4 - 4, step=1)
        items.append(Item(slot, reader, param.reshape(-1)[128:].clone(), 128, blocks, mxfp8_codes=True))
    one = fused.launch(items, True)
    assert one is not None and (one.off_div, one.last_div) == (16, BLOCK)
    flags = torch.zeros(1, dtype=torch.int32)
    one(flags, 0, torch.zeros((), dtype=torch.int64))
    assert int(flags[0]) == 3 + 2


def test_items_that_cannot_share_a_launch_get_none() -> None:
    """Main shards of two dtypes have no whole-element offset between them: the shard check then
    launches per item (``ShardCheck._flush_fused``)."""
    from dataclasses import replace

    items, _ = fused_items(4, _phase(4))
    assert fused.launch(items, True) is not None
    items[-1] = replace(items[-1], main=items[-1].main.to(torch.bfloat16))
    assert fused.launch(items, True) is None


def _phase(stride: int) -> Any:
    from mbridge_mxfp8_plugin.verify.sampling import Phase

    return Phase(stride)


# ------------------------------------------- plain (values) params: one launch per batch too
def _today(batch: Any, value: int, atol: float) -> int:
    """Differing elements at phase ``value`` as the gathers count them (``sides``, ``_count``):
    not equal, nor within ``atol``, nor NaN on both sides (a NaN against a number differs)."""
    from mbridge_mxfp8_plugin.verify.batches import at_phase, sides

    part = at_phase(batch, value)
    if not part.items:
        return 0
    got, want, _ = sides(part, {})
    same = (got == want) | (got.isnan() & want.isnan())
    if atol:
        same |= (got.float() - want.float()).abs() <= atol
    return int((~same).sum())


def _kernel(batch: Any, phase: Any, atol: float) -> int:
    one = fused.values_launch(batch.items, batch.round_to, batch.param.dtype, atol)
    assert one is not None
    assert [s.items.shape for s in one.segments] == [(len(batch.items), len(fused.VALUE_FIELDS))]
    flags = torch.zeros(3, dtype=torch.int32)
    one(flags, 1, phase.tensor(torch.device("cpu")))
    assert flags[0] == 0 and flags[2] == 0  # only its own counter is written
    return int(flags[1])


_ROUNDINGS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float16, None),
              (torch.bfloat16, torch.float16), (torch.float32, None)]  # fmt: skip


@pytest.mark.parametrize("stride", [1, 4])
@pytest.mark.parametrize(("dtype", "round_to"), _ROUNDINGS)
def test_a_values_batch_is_one_launch_with_the_counts_of_the_gathers(
    monkeypatch: pytest.MonkeyPatch, stride: int, dtype: torch.dtype, round_to: Any
) -> None:
    """Every run of every param changed in a few elements (tails too), a NaN and an infinity in
    the main shards: the launch counts at every phase exactly the differing elements of the
    phase's blocks that the gathers count, exactly and within an ``atol``; one launch per phase."""
    from mbridge_mxfp8_plugin.verify import _values_kernel

    batch, phase, flats = values_batch(stride, dtype, round_to)
    for slot, (flat, (_, _, s)) in enumerate(zip(flats, VALUE_SHAPES, strict=True)):
        j = torch.arange(flat.numel() - s)
        changed = s + j[(j % 32) < (j // 32 + slot + 1) % 5]
        flat[changed] = flat[changed] * 1.01 + (changed % 3).to(dtype) * 0.002
    batch.items[2].main[7], batch.items[3].main[33] = float("nan"), float("inf")
    launches = Launches(_values_kernel.items_kernel)
    monkeypatch.setattr(_values_kernel, "items_kernel", launches)
    for offset in range(stride):
        phase.set(offset)
        for atol in (0.0, 0.01):
            want = _today(batch, offset, atol)
            assert want > 0 and _kernel(batch, phase, atol) == want, (offset, atol)
    assert launches.count == 2 * stride


@pytest.mark.parametrize(("dtype", "round_to"), _ROUNDINGS[:4])
def test_a_changed_value_of_the_third_param_is_found_at_its_phase_only(
    dtype: torch.dtype, round_to: Any
) -> None:
    """Nothing differs at any phase until one value of the third param changes, in a run sampled
    at phase 2 only: counted then and only then; a NaN in the param where its main shard holds
    a number (phase 3) is a difference too, within ``atol`` as well."""
    stride = 4
    batch, phase, flats = values_batch(stride, dtype, round_to)
    s = VALUE_SHAPES[2][2]
    counts = [0] * stride
    for offset in range(stride):
        phase.set(offset)
        counts[offset] = _kernel(batch, phase, 0.0)
    assert counts == [0] * stride
    flats[2][s + (2 + 4 * 5) * 32 + 17] += 1.0  # run 22 of the shard: 22 % 4 == 2
    flats[2][s + (3 + 4 * 7) * 32] = float("nan")  # run 31: phase 3
    for atol in (0.0, 0.5):
        for offset in range(stride):
            phase.set(offset)
            counts[offset] = _kernel(batch, phase, atol)
            assert counts[offset] == _today(batch, offset, atol), (offset, atol)
        assert counts == [0, 0, int(atol < 1.0), 1], atol


def test_atol_is_compared_as_the_gathers_compare_it() -> None:
    """Within ``atol`` is no difference, past it is one; exactly, both are."""
    batch, phase, flats = values_batch(1, torch.float32, None)
    s = VALUE_SHAPES[1][2]
    flats[1][s + 40] += 0.004
    flats[1][s + 41] -= 0.02
    phase.set(0)
    assert _kernel(batch, phase, 0.0) == _today(batch, 0, 0.0) == 2
    assert _kernel(batch, phase, 0.01) == _today(batch, 0, 0.01) == 1


@pytest.mark.parametrize("atol", [0.0, 0.01])
@pytest.mark.parametrize(("dtype", "round_to"), _ROUNDINGS[:3])
def test_nan_and_inf_on_both_sides_are_equal_a_nan_against_a_number_is_not(
    dtype: torch.dtype, round_to: Any, atol: float
) -> None:
    """NaN on both sides, inf and -inf on both, are no difference, exact or within ``atol`` (a
    flagged batch would only be judged again, by value, at a cost); a NaN in the param where the
    main shard has a number is one."""
    batch, phase, flats = values_batch(1, dtype, round_to)
    s = VALUE_SHAPES[1][2]
    main = next(it.main for it in batch.items if it.slot == 1)
    for k, value in ((40, float("nan")), (41, float("inf")), (42, float("-inf"))):
        main[k] = value
        flats[1][s + k] = value
    flats[1][s + 43] = float("nan")
    phase.set(0)
    assert _kernel(batch, phase, atol) == _today(batch, 0, atol) == 1


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dtype", "round_to"), _ROUNDINGS)
def test_the_main_is_rounded_as_torch_rounds_it(
    dtype: torch.dtype, round_to: Any, main_dtype: torch.dtype
) -> None:
    """Ties, the subnormal ranges (fp16's, and fp32's that bf16 keeps), fp16's overflow to
    infinity and both zeros, from an fp32 or a bf16 main shard: a param holding
    ``main.to(round_to).to(dtype)`` differs nowhere."""
    from mbridge_mxfp8_plugin.verify.batches import Batch, Item
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_runs

    tiny, big = 2.0**-24, 65504.0
    edges = [0.0, -0.0, tiny, tiny * 0.5, tiny * 1.5, tiny * 2.5, 2.0**-14, 2.0**-14 * (1 - 2**-12), big,
             65519.0, 65520.0, 65536.0, 1e6, 2.0**-130, 3.4e38, float("inf"), 1 + 2**-8, 1 + 3 * 2**-8,
             1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-9 + 2**-20]  # fmt: skip
    base = torch.tensor(edges)
    gen = torch.Generator().manual_seed(0)
    main = torch.cat([base, -base, torch.randn(960, generator=gen) * torch.exp2(torch.randint(-30, 17, (960,),
                      generator=gen).float())]).to(main_dtype)  # fmt: skip
    flat = (main.to(round_to) if round_to is not None else main).to(dtype)
    phase = Phase(1)
    phase.reserve(torch.device("cpu"), 1)
    blocks, tail = sampled_runs(0, main.numel(), phase)
    views = (flat[-tail:], main[-tail:]) if tail else None
    batch = Batch(
        ("values",), flat, False, round_to, [Item(0, Reader(flat), main, 0, blocks, views)], blocks.count
    )
    assert _kernel(batch, phase, 0.0) == _today(batch, 0, 0.0) == 0


def test_values_batches_the_kernel_does_not_read_keep_the_gathers() -> None:
    """No launch for main shards of two dtypes, a param read as another dtype than its own, or a
    main it does not round (fp64)."""
    from dataclasses import replace

    batch, _, _ = values_batch(4, torch.bfloat16, torch.bfloat16)
    items = batch.items
    assert fused.values_launch(items, torch.bfloat16, torch.bfloat16, 0.0) is not None
    assert fused.values_launch(items, torch.bfloat16, torch.float16, 0.0) is None
    other = [*items[:-1], replace(items[-1], main=items[-1].main.to(torch.bfloat16))]
    assert fused.values_launch(other, torch.bfloat16, torch.bfloat16, 0.0) is None
    wide = [replace(it, main=it.main.double()) for it in items]
    assert fused.values_launch(wide, torch.bfloat16, torch.bfloat16, 0.0) is None


# ------------------------------------- own-write batches: their gathers as one launch per batch
_OWN_CASES = [(torch.float32, torch.bfloat16, None), (torch.float32, None, None),
              (torch.bfloat16, None, None), (torch.float32, torch.bfloat16, 2)]  # fmt: skip


@pytest.mark.parametrize(("main_dtype", "round_to", "max_rows"), _OWN_CASES)
def test_an_own_write_batch_is_gathered_and_compared_by_one_launch_each(
    monkeypatch: pytest.MonkeyPatch, main_dtype: torch.dtype, round_to: Any, max_rows: int | None
) -> None:
    """At every phase the gather launch gives exactly the rows ``main_rows`` makes (rounded, with
    their zero rows), and the compare launch counts exactly the written bytes that differ from
    the param's codes and scale bytes (``got_bytes``): a flipped code, a flipped scale byte read
    through a strided view (a small instance keeps its scales padded), nothing for equal bytes.
    A table longer than a kernel searches is a launch of each per segment, with the same result."""
    from mbridge_mxfp8_plugin.verify import _gather_kernel, _program_rows
    from mbridge_mxfp8_plugin.verify.batches import got_bytes, main_rows

    if max_rows is not None:
        monkeypatch.setattr(_program_rows, "MAX_ROWS", max_rows)
    stride = 4
    batch, phase = own_batch(stride, main_dtype, round_to)
    one = fused.gather_launch(batch.items, round_to)
    assert one is not None
    rows = len(batch.items) + 1  # and the zero rows' own
    want = [(2, 13), (2, 13), (1, 13)] if max_rows else [(rows, len(fused.GATHER_FIELDS))]
    assert [s.items.shape for s in one.segments] == want
    gathers = Launches(_gather_kernel.items_kernel)
    compares = Launches(_gather_kernel.compare_kernel)
    monkeypatch.setattr(_gather_kernel, "items_kernel", gathers)
    monkeypatch.setattr(_gather_kernel, "compare_kernel", compares)
    bits = torch.int16 if (round_to or main_dtype).itemsize == 2 else torch.int32
    for offset in range(stride):
        phase.set(offset)
        phase.begin()
        want_rows = main_rows(batch)
        codes, scales = got_bytes(batch)
        at = phase.tensor(torch.device("cpu"))
        rows = one(at)
        assert rows.dtype == want_rows.dtype and rows.shape == want_rows.shape
        assert torch.equal(rows.view(bits), want_rows.view(bits)), offset
        written = codes.view(torch.uint8).clone()
        padded = torch.zeros((scales.numel(), 4), dtype=torch.uint8)
        padded[:, 0] = scales.view(torch.uint8)
        assert int(one.differing(written, padded[:, 0], at)) == 0, offset
        written[offset, offset] ^= 1
        written[-1, -1] ^= 0x80
        padded[offset + 2, 0] ^= 4
        assert int(one.differing(written, padded[:, 0], at)) == 3, offset
    assert gathers.count == stride * len(want) and compares.count == 2 * stride * len(want)


def test_a_plans_tables_reach_the_device_as_views_of_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Tables``: every segment of every launch made with it is, after ``upload``, a view of one
    tensor (one copy to the device, not one per segment), and reads as its own table did: the
    launches give the rows and counts of launches made without it."""
    from mbridge_mxfp8_plugin.verify import _program_rows
    from mbridge_mxfp8_plugin.verify.batches import main_rows

    monkeypatch.setattr(_program_rows, "MAX_ROWS", 2)  # several segments per launch
    batch, phase = own_batch(4, torch.float32, torch.bfloat16)
    tables = fused.Tables()
    kept = [fused.gather_launch(batch.items, torch.bfloat16, tables) for _ in range(2)]
    alone = fused.gather_launch(batch.items, torch.bfloat16)
    assert alone is not None and kept[0] is not None and kept[1] is not None
    assert [s.items for one in kept if one is not None for s in one.segments] == [None] * 6  # not sent yet
    tables.upload()
    assert [s.items.shape for s in kept[0].segments] == [s.items.shape for s in alone.segments]
    held = [s.items for one in kept if one is not None for s in one.segments]
    assert len(held) == 6 and len({t.untyped_storage().data_ptr() for t in held}) == 1
    shared = {t.untyped_storage().data_ptr() for t in held}
    assert not shared & {s.items.untyped_storage().data_ptr() for s in alone.segments}  # its own table
    for offset in range(4):
        phase.set(offset)
        phase.begin()
        at = phase.tensor(torch.device("cpu"))
        want = main_rows(batch)
        codes = torch.zeros(want.shape, dtype=torch.uint8)
        scales = torch.zeros(want.shape[0], dtype=torch.uint8)
        for one in (kept[0], kept[1]):
            assert torch.equal(one(at).view(torch.int16), want.view(torch.int16)), offset
            assert int(one.differing(codes, scales, at)) == int(alone.differing(codes, scales, at)) > 0


def test_own_write_batches_the_gather_does_not_read_keep_the_gathers() -> None:
    """Ragged rows, a rounding it does not make, main shards of two dtypes: None."""
    from dataclasses import replace

    batch, _ = own_batch(4, torch.float32, torch.bfloat16)
    assert fused.gather_launch(batch.items, torch.float16) is None
    items = list(batch.items)
    items[-1] = replace(items[-1], main=items[-1].main.to(torch.bfloat16))
    assert fused.gather_launch(items, torch.bfloat16) is None
    ragged, _ = fused_items(4, _phase(4))
    assert fused.gather_launch(ragged, torch.bfloat16) is None
