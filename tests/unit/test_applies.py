"""Whether the plugin has anything to do for a job, and whether the loop already does it all
(engine/applies.py), asked directly on the unit tier's fakes of megatron-core.

``decide`` applies only to megatron-core DDP chunks in the reuse mode whose sync nobody else owns,
and says why not otherwise (the line every adapter logs). ``loop_does_the_work`` is true only where
core 0.19 writes back, resets and stages on request, the loaded loop stages before every forced
sync, and every distributed optimizer's own config has both reuse and the overlapped gather
(docs/upstream.md): one missing condition and the engine must act itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from harness.fake_core import CORE_0161, CORE_0182, CORE_0192, BucketlessChunk, make_job

from mbridge_mxfp8_plugin.engine import applies
from mbridge_mxfp8_plugin.engine.applies import Decision, decide, loop_does_the_work
from mbridge_mxfp8_plugin.probes.owners import LAYER_WISE, MEGATRON_FSDP, SyncOwner


def test_megatron_ddp_in_the_reuse_mode_applies() -> None:
    job = make_job(CORE_0161)
    decision = decide([job.chunk], job.opt)
    assert decision.applies and decision.reason is None and decision.owner is None
    assert decide([BucketlessChunk(), BucketlessChunk()]).applies  # no optimizer yet: still the mode


def test_reuse_off_does_not_apply_and_says_which_knob() -> None:
    decision = decide([BucketlessChunk(reuse=False)])
    assert not decision.applies and decision.owner is None
    assert "reuse_grad_buf_for_mxfp8_param_ag" in str(decision.reason)
    chunk = BucketlessChunk()
    chunk.ddp_config.use_distributed_optimizer = False  # reuse needs the distributed optimizer
    assert not decide([chunk]).applies


def test_chunks_that_are_not_megatron_ddp_are_named() -> None:
    decision = decide([BucketlessChunk(), torch.nn.Linear(2, 2)])
    assert not decision.applies and decision.owner is None
    assert "Linear" in str(decision.reason) and "DistributedDataParallel" in str(decision.reason)


@pytest.mark.parametrize("owner", [MEGATRON_FSDP, LAYER_WISE])
def test_an_owner_found_earlier_decides_and_is_named(owner: str) -> None:
    """Bridge's save hands the unwrapped modules; the owner found at train start still decides."""
    found = SyncOwner(owner, "SomeWrapper")
    decision = decide([BucketlessChunk()], None, owner=found)
    assert not decision.applies and decision.owner is found
    assert decision.reason == Decision.owned_by(found).reason
    assert owner in str(decision.reason) and "SomeWrapper" in str(decision.reason)


def test_a_chunk_configured_for_megatron_fsdp_is_owned_by_it() -> None:
    chunk = BucketlessChunk()
    chunk.ddp_config.use_megatron_fsdp = True
    decision = decide([chunk])
    assert not decision.applies and decision.owner is not None
    assert decision.owner.owner == MEGATRON_FSDP


# -- loop_does_the_work ------------------------------------------------------------------------------
@pytest.fixture
def live_loop(monkeypatch: pytest.MonkeyPatch):
    """Set what the loaded training loop answers (True: stages before every forced sync)."""

    def set_to(value: bool | None) -> None:
        monkeypatch.setattr(applies, "probe_live_loop", lambda: value)

    set_to(True)
    return set_to


def test_core_019_and_a_staging_loop_do_all_the_work(live_loop) -> None:
    job = make_job(CORE_0192)
    assert loop_does_the_work(CORE_0192.behaviour(), job.opt) is True


@pytest.mark.parametrize("release", [CORE_0161, CORE_0182], ids=lambda r: r.name)
def test_older_core_never_leaves_the_work_to_the_loop(live_loop, release) -> None:
    job = make_job(release)
    assert loop_does_the_work(release.behaviour(), job.opt) is False


@pytest.mark.parametrize(
    "missing", ["has_prepare_for_param_sync", "forced_sync_writes_back", "has_dispatch_reset"]
)
def test_each_core_condition_is_needed(live_loop, missing: str) -> None:
    from dataclasses import replace

    job = make_job(CORE_0192)
    assert loop_does_the_work(replace(CORE_0192.behaviour(), **{missing: False}), job.opt) is False


@pytest.mark.parametrize("answer", [False, None], ids=["loop-does-not-stage", "no-loop-loaded"])
def test_the_loaded_loop_must_stage(live_loop, answer) -> None:
    live_loop(answer)
    job = make_job(CORE_0192)
    assert loop_does_the_work(CORE_0192.behaviour(), job.opt) is False


@pytest.mark.parametrize("knob", ["reuse_grad_buf_for_mxfp8_param_ag", "overlap_param_gather"])
def test_every_distributed_optimizer_needs_reuse_and_overlap(live_loop, knob: str) -> None:
    """Core 0.19 stages only for an optimizer whose own config has both: one member without them
    in a chained optimizer is enough to need the engine."""
    good, bad = make_job(CORE_0192), make_job(CORE_0192)
    setattr(bad.opt.config, knob, False)
    chained = SimpleNamespace(chained_optimizers=[good.opt, bad.opt])
    assert loop_does_the_work(CORE_0192.behaviour(), chained) is False
    assert loop_does_the_work(CORE_0192.behaviour(), SimpleNamespace(chained_optimizers=[good.opt]))


def test_no_distributed_optimizer_means_nothing_is_known(live_loop) -> None:
    behaviour = CORE_0192.behaviour()
    assert loop_does_the_work(behaviour, None) is False
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert loop_does_the_work(behaviour, plain) is False
    assert loop_does_the_work(behaviour, SimpleNamespace(chained_optimizers=[])) is False
