"""The replica check's fold (verify/replica.py), in one process: two "ranks'" copies of a param are
folded and reduced as the all-reduce would (its MAX stood in for by the elementwise max of both
ranks' vectors), so what each rank would learn is read off the same code path.

What it must fold is what the GEMMs read: for a param holding codes (the kit's TE-shaped type), the
codes *and the E8M0 scale bytes of real blocks*, so a drift that flips only a scale byte on one
rank (every element of that block doubles, no code bit changes) is a replica mismatch (issue
32.5); the padding of the scale tiles, which no kernel reads or writes, is not folded. The same
all-reduce carries each rank's shard mismatch count: a rank whose own shard check found nothing
learns a peer's count. The rank-level cases: tests/ranks/test_replica.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
from mbridge_mxfp8_plugin.verify import replica
from mbridge_mxfp8_plugin.verify.read import BLOCK, Reader, reader_for
from mbridge_mxfp8_plugin.verify.replica import fold_sources, reduce_folds, row_sums
from mbridge_mxfp8_plugin.verify.report import WeightReport

GROUP = object()  # a data-parallel group of two (the fake all-reduce ignores it)


def _te_param(rows: int, last: int, seed: int = 0) -> Any:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn(rows, -(-last // BLOCK), BLOCK, generator=gen)
    blocks *= torch.exp2(torch.randint(-6, 7, (rows, blocks.shape[1], 1), generator=gen).float())
    values = blocks.reshape(rows, -1)[:, :last].to(torch.bfloat16)
    return TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)


def _sums(param: Any, stride: int = 1, offset: int = 0) -> list[torch.Tensor]:
    reader = reader_for(param) if hasattr(param, "_rowwise_data") else Reader(param.reshape(-1))
    assert not isinstance(reader, str)
    return row_sums(fold_sources(param, reader), stride, offset)


def _reduce(
    per_rank: list[list[list[torch.Tensor]]], mismatches: list[int], monkeypatch: pytest.MonkeyPatch
) -> list[WeightReport]:
    """Each rank's report after one reduce of its params' row sums (``per_rank[r][i]`` is rank
    ``r``'s sums of param ``i``), with ``mismatches[r]`` as its own shard mismatch count."""

    def each_rank() -> list[WeightReport]:
        reports = []
        for sums, count in zip(per_rank, mismatches, strict=True):
            rep = WeightReport(event="test", shard_mismatch_count=count)
            reduce_folds({id(GROUP): (GROUP, sums, [f"p{i}" for i in range(len(sums))])}, rep, 5, None)
            reports.append(rep)
        return reports

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda vec, **_: sent.append(vec.clone()))
    each_rank()  # what each rank puts into the all-reduce
    reduced = torch.stack(sent).amax(dim=0)  # ReduceOp.MAX over the two ranks

    def all_reduce(vec: torch.Tensor, op: Any = None, group: Any = None) -> None:
        assert op == torch.distributed.ReduceOp.MAX and group is GROUP
        vec.copy_(reduced)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return each_rank()


@pytest.mark.parametrize("last", [256, 96], ids=["whole-tile rows", "padded scale rows"])
def test_a_drifted_scale_byte_alone_is_a_replica_mismatch(last: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's copy differs from rank 0's in one E8M0 byte only: every rank names the param."""
    mine = _te_param(64, last)
    drifted = mine.clone()
    drifted._rowwise_scale_inv[7, 2] += 1
    assert torch.equal(drifted._rowwise_data, mine._rowwise_data)  # no code bit changed
    other = _te_param(64, last, seed=1)  # a second param, alike on both ranks
    reports = _reduce([[_sums(mine), _sums(other)], [_sums(drifted), _sums(other)]], [0, 0], monkeypatch)
    for rep in reports:
        assert not rep.ok and rep.replica_mismatches == ["p0"], rep.message()
        assert rep.replica_mismatch_count == 1 and rep.shard_mismatch_count == 0


@pytest.mark.parametrize("last", [256, 96], ids=["whole-tile rows", "padded scale rows"])
def test_the_sampled_fold_finds_a_drifted_scale_byte_within_the_stride(
    last: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the default sample (1/16) the fold's rows rotate with the offset: some call of every
    16 folds the drifted scale byte."""
    mine = _te_param(64, last)
    drifted = mine.clone()
    drifted._rowwise_scale_inv[7, 2] += 1
    found = []
    for offset in range(16):
        reports = _reduce([[_sums(mine, 16, offset)], [_sums(drifted, 16, offset)]], [0, 0], monkeypatch)
        found.append(reports[0].replica_mismatch_count)
    assert any(found), found


def test_the_scale_tiles_padding_is_not_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE leaves the padding of the (128, 4) scale tiles uninitialised: its bytes may differ
    between replicas without any GEMM reading them."""
    mine = _te_param(64, 96)  # 3 blocks a row, scales padded to (128, 4)
    assert tuple(mine._rowwise_scale_inv.shape) == (128, 4)
    padded = mine.clone()
    padded._rowwise_scale_inv[:, 3] = 0xAB  # the padding column
    padded._rowwise_scale_inv[64:] = 0xCD  # the padding rows
    reports = _reduce([[_sums(mine)], [_sums(padded)]], [0, 0], monkeypatch)
    assert all(rep.ok and rep.replica_mismatch_count == 0 for rep in reports), reports[0].message()


def test_a_drifted_code_and_a_drifted_bf16_value_are_replica_mismatches(monkeypatch) -> None:
    codes = _te_param(64, 256)
    drifted_codes = codes.clone()
    drifted_codes._rowwise_data[3, 17] ^= 0x01
    bf16 = torch.randn(4096 + 100).to(torch.bfloat16)  # a short last row: folded at stride 1
    drifted_bf16 = bf16.clone()
    drifted_bf16[-3] = -drifted_bf16[-3]
    reports = _reduce(
        [[_sums(codes), _sums(bf16)], [_sums(drifted_codes), _sums(drifted_bf16)]], [0, 0], monkeypatch
    )
    for rep in reports:
        assert rep.replica_mismatches == ["p0", "p1"], rep.message()


def test_a_peers_shard_mismatch_count_reaches_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's shard check found 2 params wrong; the replicas agree, so rank 1 learns of it only
    from the count carried by the all-reduce: its report is not ok."""
    param = _te_param(64, 256)
    reports = _reduce([[_sums(param)], [_sums(param.clone())]], [2, 0], monkeypatch)
    assert all(rep.replica_mismatch_count == 0 and rep.peer_mismatch_count == 2 for rep in reports)
    assert not reports[1].ok and reports[1].shard_mismatch_count == 0
    assert "a data-parallel peer found 2 params that differ" in reports[1].message()


def test_the_fold_weights_rows_by_position() -> None:
    """Two rows swapped between replicas change the fold (each row sum is weighted by its
    position), though the sum of all rows is the same."""
    a = [torch.tensor([5, 9, 2], dtype=torch.int64)]
    b = [torch.tensor([9, 5, 2], dtype=torch.int64)]
    folds = replica._folds([a, b], torch.device("cpu"))
    assert folds[0] != folds[1]
