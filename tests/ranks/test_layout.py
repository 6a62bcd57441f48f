"""megatron-core's DDP and distributed-optimizer layout as mcore/layout.py reads it, on a real DDP +
DistributedOptimizer (the toy job: dense and expert-parallel layers, numels that are not multiples
of 64), 2 gloo ranks, in every release-pair cell: the attribute names are core's private ones and
move between releases, and this module is the one place that reads them.

Each reading is judged by what core itself does with the same layout, not by the reader: every
param sits in exactly one bucket; the padded range of a param is where core put its ``main_grad``;
staging the main shards where :func:`main_shards` says writes the same buffer bytes as core's own
``_copy_main_params_to_param_buffer``; the expert buffers replicate over the expert data-parallel
group, the dense ones over the data-parallel group.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytestmark = pytest.mark.matrix  # the layout is core's private one: every release-pair cell

_DIMS = (32, 45, 45, 45, 45, 10)  # as test_buckets.py: no weight numel a multiple of 64
_EXPERT_LAYERS = (2, 3)


def _layout_rank() -> dict[str, Any]:
    import torch

    from mbridge_mxfp8_plugin.mcore import layout
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    with cpu_shim(), emulated_mxfp8():
        toy = ToyConfig(dims=_DIMS, expert_layers=_EXPERT_LAYERS, expert_model_parallel_size=2)
        job = build_job(toy)
        model, chunk = job.model, job.model[0]
        out["ddp"] = (layout.is_megatron_ddp(chunk), layout.is_megatron_ddp(chunk.module))
        out["not_ddp"] = layout.is_megatron_ddp(torch.nn.Linear(2, 2))
        out["fsdp"] = layout.is_megatron_fsdp(chunk)
        out["reuse"] = layout.reuse_mode_active(model)
        out["layer_wise_marks"] = layout.has_layer_wise_marks(chunk)
        out["reference_reuse"] = layout.reuse_mode_active(build_job(ToyConfig(reference=True)).model)

        refs = list(layout.buffers(model))
        out["buffers"] = [(r.chunk_index, r.expert, r.index) for r in refs]
        out["core_buffers"] = (len(chunk.buffers), len(chunk.expert_parallel_buffers))
        out["group_sizes"] = {r.expert: r.data_parallel_group.size() for r in refs}
        names = {p: n for n, p in chunk.named_parameters()}
        seen: list[str] = []
        offsets = []
        for ref in refs:
            for bucket in ref.bucket_list:
                naive = 0  # the running sum of numels: what defect A's offsets are
                for p in layout.bucket_params(bucket):
                    seen.append(names[p])
                    start, end = layout.padded_range(ref.buffer, bucket, p)
                    grad = p.main_grad
                    at = grad.storage_offset() - bucket.grad_data.storage_offset()
                    same = grad.untyped_storage().data_ptr() == bucket.grad_data.untyped_storage().data_ptr()
                    offsets.append((names[p], same, (at, at + grad.numel()), (start, end), naive))
                    naive += p.numel()
        out["seen"] = sorted(seen)
        out["trainable"] = sorted(n for n, p in chunk.named_parameters() if p.requires_grad)
        out["offsets"] = offsets
        groups = layout.bucket_groups(model)
        core_groups = list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
        out["groups_in_order"] = [id(g) for g in groups] == [id(g) for g in core_groups]
        in_buffers = {id(b) for r in refs for b in r.bucket_list}
        out["group_buckets_known"] = all(id(b) in in_buffers for g in groups for b in layout.group_buckets(g))

        opts = layout.distributed_optimizers(job.optimizer)
        members = list(job.optimizer.chained_optimizers)
        out["optimizers"] = (len(opts), len(members), [type(o).__name__ for o in opts])
        out["single"] = layout.distributed_optimizers(opts[0]) == [opts[0]]
        out["main_params"] = sum(1 for _ in layout.main_params(job.optimizer))
        out["shards"], out["staging"], out["shard_vs_padded"] = 0, [], []
        buffer_of = {id(b): r.buffer for r in refs for b in r.bucket_list}
        for opt in opts:
            shards = list(layout.main_shards(opt))
            out["shards"] += sum(1 for s in shards if s.main is not None)
            for s in shards:
                bucket = next(b for r in refs for b in r.bucket_list if b.param_data is s.bucket_data)
                padded = layout.padded_range(buffer_of[id(bucket)], bucket, s.param)[0]
                out["shard_vs_padded"].append(
                    (s.bucket_start - s.param_start == padded, s.param_end - s.param_start == s.main.numel())
                )
            # Core's own staging, then the same from main_shards: the buffers must hold the same bytes.
            for c in model:
                c.zero_grad_buffer()
            opt._copy_main_params_to_param_buffer()
            core = [s.bucket_data.detach().clone() for s in shards]
            for c in model:
                c.zero_grad_buffer()
            with torch.no_grad():
                for s in shards:
                    s.bucket_data.view(-1)[s.bucket_start : s.bucket_end].copy_(s.main)
            ours = [s.bucket_data.detach().clone() for s in shards]
            nonzero = any(int(t.count_nonzero()) > 0 for t in core)
            out["staging"].append((nonzero, all(torch.equal(a, b) for a, b in zip(core, ours, strict=True))))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    from mbridge_mxfp8_plugin.testing import launch

    return launch(_layout_rank, 2)  # type: ignore[no-any-return]


def test_the_ddp_and_the_reuse_mode_are_recognised(ranks) -> None:
    for r in ranks:
        assert r["ddp"] == (True, False)  # the DDP, not the module it wraps
        assert r["not_ddp"] is False and r["fsdp"] is False and r["layer_wise_marks"] is False
        assert r["reuse"] is True and r["reference_reuse"] is False


def test_every_buffer_dense_then_expert_and_every_param_once(ranks) -> None:
    for r in ranks:
        dense, expert = r["core_buffers"]
        assert dense >= 1 and expert >= 1
        assert r["buffers"] == [(0, False, i) for i in range(dense)] + [(0, True, i) for i in range(expert)]
        assert r["seen"] == r["trainable"]  # no param twice, none left out
        assert r["groups_in_order"] and r["group_buckets_known"]


def test_buffers_replicate_over_their_own_data_parallel_group(ranks) -> None:
    """World 2 with expert-parallel size 2: dense params on both ranks, each expert on one."""
    for r in ranks:
        assert r["group_sizes"] == {False: 2, True: 1}


def test_a_params_padded_range_is_where_core_put_its_main_grad(ranks) -> None:
    for r in ranks:
        wrong = [(n, at, padded) for n, same, at, padded, _ in r["offsets"] if not same or at != padded]
        assert not wrong, wrong
        # the layout is one where padding matters: some start is not the running sum of numels
        assert any(padded[0] != naive for *_, padded, naive in r["offsets"])


def test_main_shards_are_where_core_stages_them(ranks) -> None:
    for r in ranks:
        n_opts, n_members, kinds = r["optimizers"]
        assert n_opts == n_members == 2 and set(kinds) == {"DistributedOptimizer"}  # dense + expert
        assert r["single"] and r["shards"] == r["main_params"] > 0
        assert r["shard_vs_padded"] and all(a and b for a, b in r["shard_vs_padded"]), r["shard_vs_padded"]
        assert r["staging"] == [(True, True)] * n_opts
