"""Batches of the verifier's kernels as the shard check plans them (``ShardCheck.add``, ``pack``),
built on CPU for tests/unit/test_fused.py: the launch tests and the batch builders are split by job.

Each builder makes the awkward cases a real plan meets (ragged rows, shards from mid-row and
mid-block, a param split across batches, main shards that are views of one buffer at an odd
offset), so a kernel that handles only the regular case fails its test.
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_mxfp8_plugin.common.mxfp8_cast import mxfp8_cast
from mbridge_mxfp8_plugin.verify.read import BLOCK, Reader

__all__ = ["VALUE_SHAPES", "Launches", "fused_items", "own_batch", "te_reader", "values_batch", "wide"]


def wide(rows: int, last: int, seed: int) -> torch.Tensor:
    """fp32 rows whose blocks span amax from 2**-40 to 2**40 (not bf16-exact)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-40, 40, (rows, 1), generator=gen).float())
    return torch.randn(rows, last, generator=gen) * scale


def te_reader(values: torch.Tensor) -> tuple[Reader, torch.Tensor, torch.Tensor]:
    """A param's codes and scales as TE's rule writes ``values`` (already as the gather rounds them)."""
    codes, scales = mxfp8_cast(values)
    codes, scales = codes.view(torch.uint8).reshape(-1).clone(), scales.reshape(-1).clone()
    return Reader(codes, scales, -(-values.shape[-1] // BLOCK), torch.float8_e4m3fn), codes, scales


class Launches:
    """Counts a Triton kernel's launches (each is the kernel indexed by its grid)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid: Any) -> Any:
        self.count += 1
        return self.kernel[grid]


def fused_items(stride: int, phase: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """A fused batch's items: params of whole-block, ragged (45, 96) and short rows, shards from
    a row's start, mid-row and mid-block, two of them views of one buffer at an odd element
    offset, the first split in two parts (as ``pack`` splits a param across batches)."""
    from mbridge_mxfp8_plugin.verify.batches import Item
    from mbridge_mxfp8_plugin.verify.sampling import sampled_mxfp8

    shapes = ((12, 256, 256 + 64), (20, 45, 2 * 45 + 7), (14, 96, 96 + 40), (9, 64, 0))
    shared = torch.zeros(3 + sum(r * last for r, last, _ in shapes[:2]))
    at, items, codes = 3, [], []
    for slot, (rows, last, s) in enumerate(shapes):
        param = wide(rows, last, seed=slot + 11)
        reader, code, _ = te_reader(param.to(torch.bfloat16))
        codes.append(code)
        tail = param.reshape(-1)[s:]
        if slot < 2:  # shares the buffer with another item's shard
            main = shared[at : at + tail.numel()]
            main.copy_(tail)
            at += tail.numel()
        else:
            main = tail.clone()
        blocks, _ = sampled_mxfp8(param, s, param.numel(), phase)
        half = blocks.count // 2
        parts = [blocks.part(0, half), blocks.part(half, blocks.count - half)]
        for part in parts if slot == 0 else [blocks]:
            items.append(Item(slot, reader, main, s, part, mxfp8_codes=True))
    return items, codes


VALUE_SHAPES = ((12, 256, 256 + 64), (20, 45, 2 * 45 + 7), (14, 96, 96 + 43), (9, 64, 5), (1, 50, 29))


def values_batch(stride: int, dtype: torch.dtype, round_to: Any) -> tuple[Any, Any, list[torch.Tensor]]:
    """A values batch as the shard check plans it (``ShardCheck.add``, ``pack``): params of
    whole-block and ragged rows (45, 96), shards starting mid-block, the first split in two parts
    (its tail on the last), two main shards views of one buffer at an odd offset, the last shard
    shorter than a run (its tail is all it compares); at stride 1 every shard has its tail. Each
    param holds its main shard as the gather rounds it: nothing differs yet."""
    from mbridge_mxfp8_plugin.verify.batches import Batch, Item
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_runs

    phase = Phase(stride)
    shared = torch.zeros(3 + sum(r * last - s for r, last, s in VALUE_SHAPES[:2]))
    at, items, flats = 3, [], []
    for slot, (rows, last, s) in enumerate(VALUE_SHAPES):
        full = wide(rows, last, seed=slot + 5).clamp(-6e4, 6e4).reshape(-1)  # fp16's range
        flat = (full.to(round_to) if round_to is not None else full).to(dtype)
        flats.append(flat)
        e = full.numel()
        if slot < 2:
            main = shared[at : at + e - s]
            main.copy_(full[s:])
            at += e - s
        else:
            main = full[s:].clone()
        blocks, tail = sampled_runs(s, e, phase)
        views = (flat[e - tail : e], main[e - s - tail : e - s]) if tail else None
        half = blocks.count // 2
        if slot == 0:
            items.append(Item(slot, Reader(flat), main, s, blocks.part(0, half)))
            blocks = blocks.part(half, blocks.count - half)
        items.append(Item(slot, Reader(flat), main, s, blocks, views))
    batch = Batch(("values",), flats[0], False, round_to, items, sum(it.blocks.count for it in items))
    phase.reserve(torch.device("cpu"), max(it.blocks.count for it in items))
    return batch, phase, flats


def own_batch(stride: int, main_dtype: torch.dtype, round_to: Any) -> tuple[Any, Any]:
    """An own-write batch as the shard check plans it (``pack``): TE-shaped params with plain
    (rows of 256) and padded scale rows (64, 96: TE pads a row's scales to 4), shards from a
    row's start, mid-row and mid-block, the first split in two parts; fp32 mains not bf16-exact,
    with subnormals, so the rounding shows; 45 + ... blocks: not whole 32-row tiles."""
    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
    from mbridge_mxfp8_plugin.verify.batches import Batch, Item
    from mbridge_mxfp8_plugin.verify.read import reader_for
    from mbridge_mxfp8_plugin.verify.sampling import Phase, sampled_mxfp8

    phase = Phase(stride)
    batch = Batch(("own",), None, True, round_to)
    shapes = ((40, 256, 0, 0), (20, 64, 3 * 64 + 17, 5), (30, 96, 2 * 96 + 32, 0))
    for slot, (rows, last, s, cut) in enumerate(shapes):
        values = wide(rows, last, seed=slot + 31)
        values.view(-1)[::7] *= 2.0**-130  # fp32 subnormals (bf16 keeps some of their bits)
        param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values.to(torch.bfloat16))
        reader = reader_for(param)
        assert reader.scale_cols == (last // BLOCK if last == 256 else 4)
        main = values.reshape(-1)[s : values.numel() - cut].clone().to(main_dtype)
        blocks, _ = sampled_mxfp8(param, s, values.numel() - cut, phase)
        half = blocks.count // 2  # the first param split in two parts, as ``pack`` splits one
        for part in [blocks.part(0, half), blocks.part(half, blocks.count - half)] if slot == 0 else [blocks]:
            batch.items.append(Item(slot, reader, main, s, part, mxfp8_codes=True))
            batch.blocks += part.count
        phase.reserve(torch.device("cpu"), blocks.count)
    assert len(batch.items) == 4 and batch.blocks % BLOCK
    return batch, phase
