"""Megatron-FSDP and the LayerWise (Muon) optimizer own their param sync: the plugin stays passive
and says so once.

Two gloo ranks run the toy job's real DDP chunks (reuse on, overlapped param gather, emulated MXFP8
weights) through a Bridge release's loop order with the plugin's Bridge callback registered; the
job's optimizer chains megatron-core's real ``DistributedOptimizer`` with a real
``LayerWiseDistributedOptimizer`` (how Megatron-LM main builds a Muon job: tests/harness/owners.py).
What the plugin does inside every hook is counted from outside it. Bypassing the owner gate shows
the count sees the engine: it then stages, gathers and writes where the gate keeps it idle.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)

try:
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer  # noqa: F401
except ImportError:  # megatron-core < 0.16 has no LayerWise optimizer: nothing to own the sync
    HAS_LAYER_WISE = False
else:
    HAS_LAYER_WISE = True
needs_layer_wise = pytest.mark.skipif(
    not HAS_LAYER_WISE, reason="this megatron-core has no LayerWiseDistributedOptimizer (< 0.16)"
)

#: Bridge 0.5's order: it fires on_checkpoint_save (with unwrapped modules: a second model key for the
#: adapter) and leaves the plugin work to do (it stages before evals only), so the gate-less run acts.
LOOP = "0.5.1"


@pytest.fixture(scope="module")
def runs():  # type: ignore[no-untyped-def]
    from harness.owners import run_layer_wise_job

    return {gate: run_layer_wise_job(gate=gate, loop=LOOP) for gate in (True, False)}


@needs_layer_wise
def test_plugin_does_nothing_where_layer_wise_owns_the_sync(runs) -> None:  # type: ignore[no-untyped-def]
    for rank, run in enumerate(runs[True]):
        assert run.layer_wise_class.endswith(".LayerWiseDistributedOptimizer")
        events = {event for event, *_ in run.costs}
        assert {"on_train_start", "on_train_step_end", "on_eval_start", "on_test_start"} <= events, events
        busy = [c for c in run.costs if any(c[1:])]
        assert not busy, f"rank {rank}: (event, all-gathers, collectives, stagings, writes) {busy}"
        assert not run.engine_built
        assert run.inactive_reason == (
            "the LayerWise distributed optimizer owns the param sync "
            "(megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer)"
        )


@needs_layer_wise
def test_one_line_on_rank_zero_that_bridge_logging_shows(runs) -> None:  # type: ignore[no-untyped-def]
    """Bridge's default ``setup_logging`` drops records whose level is exactly WARNING (_log.py):
    the line must be above it, once per job, on rank zero only."""
    import logging

    first, second = runs[True]
    assert len(first.log_lines) == 1, first.log_lines
    level, _, text = first.log_lines[0].partition(" ")
    assert int(level) > logging.WARNING
    assert text.startswith("MXFP8 param-sync plugin passive: the LayerWise distributed optimizer owns")
    assert not second.log_lines


@needs_layer_wise
def test_the_count_sees_the_engine_without_the_gate(runs) -> None:  # type: ignore[no-untyped-def]
    """Without the gate the same job makes the engine stage the DistributedOptimizer's shards and
    write the DDP buffers (and, on core < 0.18, gather): what the gate prevents is measurable."""
    for run in runs[False]:
        assert run.engine_built and run.inactive_reason is None
        stagings = sum(c[3] for c in run.costs)
        writes = sum(c[4] for c in run.costs)
        assert stagings > 0 and writes > 0, run.costs


def _fsdp_cannot_build_here() -> str | None:
    """Why megatron-core's Megatron-FSDP cannot be built on this torch, or None.

    core 0.14's ``megatron_fsdp.utils.get_mesh_names`` reads torch's private
    ``_mesh_resources.child_to_root_mapping`` unguarded; torch 2.13 removed it, so the wrapper's
    constructor raises before any plugin code runs (core 0.15 guards the read with ``try``)."""
    import inspect

    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import utils
        from torch.distributed.device_mesh import _mesh_resources
    except ImportError as exc:
        return f"no Megatron-FSDP in this megatron-core ({exc})"
    source = inspect.getsource(utils.get_mesh_names)
    if not hasattr(_mesh_resources, "child_to_root_mapping") and "try:" not in source:
        return (
            "this megatron-core's Megatron-FSDP reads torch's removed _mesh_resources.child_to_root_mapping "
            "unguarded (core 0.14 on torch >= 2.13): its constructor fails before the plugin is involved"
        )
    return None


@pytest.mark.skipif(_fsdp_cannot_build_here() is not None, reason=str(_fsdp_cannot_build_here()))
def test_megatron_fsdp_is_left_alone_with_one_visible_line() -> None:
    """A real Megatron-FSDP wrapper (megatron-core's adapter, CPU): the plugin's Bridge hooks issue
    no collective, stage nothing, write no parameter, build no engine, and log one line above
    Bridge's WARNING filter naming the owner. One rank: megatron-core's FSDP crashes the process
    (SIGSEGV) with two gloo ranks on CPU here; the gate looks at the wrapper, not at the ranks."""
    import logging

    from harness.owners import run_fsdp_job

    (run,) = run_fsdp_job(world_size=1)
    assert run.layer_wise_class.startswith("megatron.core.distributed.fsdp.")  # the real wrapper class
    assert [c[0] for c in run.costs] == [
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_eval_start",
        "on_eval_end",
        "on_checkpoint_save",
        "on_train_end",
    ]
    assert not [c for c in run.costs if any(c[1:])], run.costs
    assert not run.engine_built and run.inactive_reason.startswith("Megatron-FSDP owns the param sync")
    assert len(run.log_lines) == 1, run.log_lines
    level, _, text = run.log_lines[0].partition(" ")
    assert int(level) > logging.WARNING and text.startswith("MXFP8 param-sync plugin passive: Megatron-FSDP")
