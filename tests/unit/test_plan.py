"""The engine's copy plans (engine/plan.py) on the unit tier's fakes of megatron-core.

A write-back copies each param's slice of its bucket's gathered ``param_data`` into the param, by
the buffer's padded index map (the bucket's own ``param_to_index`` is the defect-A running sum on
core <= 0.16), zeroes the buffers shared with the gradients only when asked, and marks every
bucket group gathered. Staging copies each fp32 main shard into its slice of the bucket, without
recording autograd history, and hands layouts it cannot plan to core's own copy. Expectations are
from the layout (which slice belongs to which param), not from the plan.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from harness.fake_core import CORE_0161, N, make_job

from mbridge_mxfp8_plugin.engine.plan import StagePlans, WriteBackPlan


def _padded_bucket(job):
    """One bucket, two bf16 params of 40 and 64 elements: the buffer pads the second to start at
    64, the bucket's own offsets are the naive running sum (defect A)."""
    bucket = job.groups[0].buckets[0]
    first, second = (
        torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16), requires_grad=False) for n in (40, N)
    )
    grad = torch.zeros(2 * N, dtype=torch.float32)
    bucket.params_list, bucket.grad_data = [first, second], grad
    bucket.param_data = grad.view(torch.bfloat16)[: 2 * N]
    bucket.param_to_index = {first: (0, 40), second: (40, 40 + N)}
    job.chunk.buffers[0].param_index_map = {first: (0, 40, 0), second: (N, 2 * N, 0)}
    return bucket, first, second


def test_write_back_reads_each_param_at_its_padded_offset() -> None:
    job = make_job(CORE_0161, groups=1)
    bucket, first, second = _padded_bucket(job)
    with torch.no_grad():
        bucket.param_data[:40] = 1.0
        bucket.param_data[40:N] = 7.0  # padding: no param's element
        bucket.param_data[N:] = 2.0
    plan = WriteBackPlan.build([job.chunk])
    assert plan.params == 2
    plan.run(zero=False)
    assert torch.equal(first, torch.ones(40, dtype=torch.bfloat16))
    assert torch.equal(second, torch.full((N,), 2.0, dtype=torch.bfloat16))  # not the padding's 7


def test_write_back_zeroes_shared_buffers_only_when_asked_and_marks_groups_gathered() -> None:
    job = make_job(CORE_0161, groups=2)
    for group in job.groups:
        with torch.no_grad():
            group.buckets[0].param_data.fill_(3.0)
    plan = WriteBackPlan.build([job.chunk])
    assert plan.params == 2 and plan.groups == job.groups
    assert plan.run(zero=False) == 0
    assert job.weights() == [3.0] and all(b.param_data.eq(3.0).all() for g in job.groups for b in g.buckets)
    assert all(g.param_gather_dispatched for g in job.groups)  # the forwards must not gather again
    for group in job.groups:
        group.param_gather_dispatched = False
    assert plan.run(zero=True) == 2  # both buffers alias their grad buffers (the reuse mode)
    assert job.weights() == [3.0]
    assert all(int(b.grad_data.count_nonzero()) == 0 for g in job.groups for b in g.buckets)
    assert all(g.param_gather_dispatched for g in job.groups)


def test_write_back_skips_params_that_live_on_the_buffer() -> None:
    """bf16 params on core >= 0.17 are views of the buffer: a copy is a no-op at best."""
    job = make_job(CORE_0161, groups=1)
    bucket = job.groups[0].buckets[0]
    on_buffer = torch.nn.Parameter(bucket.param_data[:N], requires_grad=False)
    bucket.params_list, bucket.param_to_index = [on_buffer], {on_buffer: (0, N)}
    job.chunk.buffers[0].param_index_map = {on_buffer: (0, N, 0)}
    plan = WriteBackPlan.build([job.chunk])
    assert plan.params == 0 and not plan.plain_dst and not plan.quantized


# -- staging -----------------------------------------------------------------------------------------
class _Opt:
    """The distributed optimizer's layout maps, as core's ``_copy_main_params_to_param_buffer``
    reads them: each param's fp32 main shard covers ``[lo, hi)`` of the param and sits at
    ``[at + lo, at + hi)`` of its bucket's ``param_data``."""

    def __init__(self, shards: list[tuple[torch.Tensor, int, int, int]], data: torch.Tensor) -> None:
        self.model_float16_groups = [[torch.zeros(1) for _ in shards]]
        self.shard_fp32_from_float16_groups = [[main for main, *_ in shards]]
        self._ranges = {}
        for param, (_main, lo, hi, at) in zip(self.model_float16_groups[0], shards, strict=True):
            self._ranges[param] = {
                "param": SimpleNamespace(start=lo, end=hi),
                "gbuf_world_in_bucket": SimpleNamespace(start=at + lo, end=at + hi),
            }
        self.model_param_gbuf_map = {p: (0, torch.bfloat16, 0) for p in self.model_float16_groups[0]}
        self.buffers = [SimpleNamespace(buckets=[SimpleNamespace(param_data=data)])]
        self.core_copies = 0

    def _get_model_param_range_map(self, param):
        return self._ranges[param]

    def _copy_main_params_to_param_buffer(self) -> None:
        self.core_copies += 1


def test_staging_copies_each_main_shard_into_its_bucket_slice() -> None:
    data = torch.zeros(16, dtype=torch.bfloat16)
    a, b = torch.full((3,), 1.0), torch.full((2,), 2.0)
    opt = _Opt([(a, 1, 4, 0), (b, 0, 2, 8)], data)  # param 0's elements 1..3 at 1..3; param 1's at 8..9
    plans = StagePlans()
    plans.stage(opt)
    want = torch.zeros(16, dtype=torch.bfloat16)
    want[1:4], want[8:10] = 1.0, 2.0
    assert torch.equal(data, want) and opt.core_copies == 0
    a.fill_(5.0)  # the next step's main params: the kept plan reads them, not a snapshot
    plans.stage(opt)
    assert data[1:4].eq(5.0).all() and data[8:10].eq(2.0).all()


def test_staging_records_no_autograd_history() -> None:
    """A main param rebuilt by a second optimizer (NeMo: validate, then fit) carries grad history;
    a copy recorded into the buffer views would break the next gather."""
    data = torch.zeros(8, dtype=torch.bfloat16)
    leaf = torch.ones(4, requires_grad=True)
    opt = _Opt([(leaf * 3.0, 0, 4, 0)], data)
    StagePlans().stage(opt)
    assert data[:4].eq(3.0).all() and not data.requires_grad and data.grad_fn is None


@pytest.mark.parametrize("layout", ["unreadable", "main-held-inside"])
def test_a_layout_it_cannot_plan_is_left_to_cores_own_copy(layout: str) -> None:
    if layout == "unreadable":  # the fakes' optimizer has none of the maps
        job = make_job(CORE_0161)
        opt, before = job.opt, job.opt.stagings
        count = lambda: job.opt.stagings - before  # noqa: E731
    else:  # the precision-aware optimizer keeps its main params inside itself: main is None
        opt = _Opt([(torch.ones(4), 0, 4, 0)], torch.zeros(8, dtype=torch.bfloat16))
        opt.shard_fp32_from_float16_groups = [[None]]
        count = lambda: opt.core_copies  # noqa: E731
    plans = StagePlans()
    plans.stage(opt)
    plans.stage(opt)
    assert count() == 2  # asked again each time, and copied by core each time
