"""What a shard check plans (verify/batches.py): items of sampled blocks, packed into batches no
larger than their cap, and the sides a batch compares.

Packing must keep every block exactly once and in order, split an item where it crosses a
batch's border, give a bf16 shard's short last run to the item's last part only, and never
exceed the cap (that is the memory bound). A plan holds views: it reads the params' and main
shards' current bits each time. The rows a reference write gets are padded with zero rows to
whole 32-row tiles.
"""

from __future__ import annotations

import torch

from mbridge_mxfp8_plugin.verify.batches import Batch, Item, got_bytes, main_rows, pack, sides, split
from mbridge_mxfp8_plugin.verify.read import BLOCK, Blocks, Reader


def _item(slot: int, blocks: int, *, last: int = 64, tail: bool = False, seed: int = 0) -> Item:
    """A bf16 param of ``blocks`` blocks read in place, and its fp32 main shard (whole param)."""
    rows = -(-blocks * BLOCK // last)
    gen = torch.Generator().manual_seed(seed)
    main = torch.randn(rows * last + (5 if tail else 0), generator=gen)  # tail: 5 elements past the blocks
    flat = main.to(torch.bfloat16)
    views = (flat[-5:], main[-5:]) if tail else None
    return Item(slot, Reader(flat), main, 0, Blocks(last=last, start=0, count=blocks, step=1), views)


def _batch(*items: Item) -> Batch:
    batch = Batch(("key",), items[0].reader.flat, False, None)  # a bf16 param stands for the batch
    for it in items:
        batch.items.append(it)
        batch.blocks += it.blocks.count
    return batch


def _rows(batch_or_items) -> torch.Tensor:
    items = batch_or_items.items if isinstance(batch_or_items, Batch) else batch_or_items
    return torch.cat([it.got() for it in items])


def test_split_keeps_every_block_once_in_order_and_within_the_cap() -> None:
    a, b = _item(0, 100, seed=1), _item(1, 10, seed=2)
    batch = _batch(a, b)
    parts = split(batch, 32)
    assert [p.blocks for p in parts] == [32, 32, 32, 14]
    assert all(p.blocks == sum(it.blocks.count for it in p.items) for p in parts)
    assert torch.equal(torch.cat([_rows(p) for p in parts]), _rows(batch))
    assert [[it.slot for it in p.items] for p in parts] == [[0], [0], [0], [0, 1]]  # a crosses borders
    assert all(p.key == batch.key and p.round_to is batch.round_to for p in parts)
    # An item entering a half-full batch is split at the cap, not after it.
    assert [p.blocks for p in split(_batch(_item(0, 20), _item(1, 20)), 32)] == [32, 8]


def test_only_an_items_last_part_carries_its_short_run() -> None:
    item = _item(0, 70, tail=True)
    parts = split(_batch(item), 32)
    tails = [it.tail for p in parts for it in p.items]
    assert tails[:-1] == [None, None] and tails[-1] is item.tail


def test_pack_hands_over_each_batch_as_it_fills() -> None:
    full: list[Batch] = []
    template = Batch(("key",), None, False, None)

    def on_full() -> Batch:
        full.append(opened[-1])
        opened.append(template.fresh())
        return opened[-1]

    opened = [template.fresh()]
    left = pack(_item(0, 40), 16, opened[0], on_full)
    left = pack(_item(1, 8), 16, left, on_full)
    assert [b.blocks for b in full] == [16, 16, 16] and left.blocks == 0  # 48 blocks: three full
    left = pack(_item(2, 3), 16, left, on_full)
    assert left.blocks == 3 and len(full) == 3


def test_a_plan_reads_the_current_bits() -> None:
    """Aligned rows are views kept by the item; a ragged row's zero-padded gather is a copy, taken
    anew each time. Either way a second read sees what changed since the first."""
    for last in (64, 45):
        item = _item(0, 4, last=last)
        before = item.got().clone()
        item.reader.flat.add_(1.0)
        item.main.mul_(2.0)
        assert not torch.equal(item.got(), before), last
        inside = item.got() != 0
        assert torch.equal(item.got()[inside], (before + 1.0)[inside]), last
        assert torch.equal(item.want(), item.blocks.take(item.main)), last


def test_main_rows_are_padded_to_whole_tiles_with_zero_rows() -> None:
    a, b = _item(0, 5, seed=3), _item(1, 2, seed=4)
    batch = _batch(a, b)
    batch.round_to = torch.bfloat16
    rows = main_rows(batch)
    assert rows.shape == (32, BLOCK) and rows.dtype == torch.bfloat16
    want = torch.cat([a.want(), b.want()]).to(torch.bfloat16)
    assert torch.equal(rows[:7], want) and int(rows[7:].count_nonzero()) == 0
    one = _batch(_item(0, 32, seed=5))
    assert torch.equal(main_rows(one), one.items[0].want())  # one whole tile: no padding


def test_sides_of_a_bf16_batch_are_the_params_and_their_rounded_mains() -> None:
    a, b = _item(0, 3, seed=6, tail=True), _item(1, 2, seed=7)
    batch = _batch(a, b)
    got, want, small = sides(batch, {})
    assert small is None  # no reference instance: bf16 values compare directly
    assert got.shape == want.shape == (3 + 1 + 2, BLOCK)  # a's short run is one zero-padded row
    assert torch.equal(got, want)  # the params hold their mains rounded to bf16
    assert torch.equal(got[3, :5], a.tail[0]) and int(got[3, 5:].count_nonzero()) == 0
    a.reader.flat[0] += 1.0
    got, want, _ = sides(batch, {})
    assert not torch.equal(got, want)


def test_got_bytes_gathers_the_codes_and_scales_of_every_item() -> None:
    def coded(slot: int, blocks: int, fill: int) -> Item:
        codes = torch.full((blocks * BLOCK,), fill, dtype=torch.uint8)
        scales = torch.arange(blocks, dtype=torch.uint8) + fill
        reader = Reader(codes, scales, 1, torch.float8_e4m3fn)
        blocks_ = Blocks(last=BLOCK, start=0, count=blocks, step=1)
        return Item(slot, reader, torch.zeros(blocks * BLOCK), 0, blocks_, mxfp8_codes=True)

    one = _batch(coded(0, 3, 10))
    codes, scales = got_bytes(one)
    assert codes.data_ptr() == one.items[0].reader.flat.data_ptr()  # one item: views, no copy
    assert scales.tolist() == [10, 11, 12]
    two = _batch(coded(0, 2, 10), coded(1, 1, 50))
    codes, scales = got_bytes(two)
    assert codes[:2].eq(10).all() and codes[2].eq(50).all() and scales.tolist() == [10, 11, 50]
