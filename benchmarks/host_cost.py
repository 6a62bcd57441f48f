"""Host-side costs of the plugin, the part of ``eval_sync.py worker`` that is not the gather:

* ``hooks_*``: the Bridge callback's hooks on training steps with no forced sync ahead (time per
  step, all-gathers issued: must be none);
* ``host`` (``--host-params``): on a model of ~10k small params, the host time per param of a
  whole refresh, of the write-back, of the engine's own loop (quantizer doing nothing), of core's
  staging and of the restore at the next step.
"""

from __future__ import annotations

import time
from typing import Any

from _casts import plain_quantizer
from _job import GatherCounter, between_evals, prepared_job, timeit


def measure_hooks(job: Any) -> dict[str, Any]:
    """Hooks on a training step with no forced sync ahead: what the callback costs per step."""
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback

    # validate=False: the config check runs once at train start and needs the config readers,
    # which the GPU host need not have; the per-step cost measured here does not include it.
    cb = MXFP8ParamSyncCallback(validate=False)
    state = SimpleNamespace(
        cfg=SimpleNamespace(
            train=SimpleNamespace(eval_interval=1000, train_iters=10**6, exit_interval=None),
            checkpoint=SimpleNamespace(save=None, save_interval=None),
        ),
        train_state=SimpleNamespace(step=1, do_valid=True),
    )
    ctx = SimpleNamespace(model=job.model, optimizer=job.optimizer, state=state)
    cb.on_train_start(ctx)
    counter = GatherCounter()
    t0 = time.perf_counter()
    for _ in range(1000):
        cb.on_train_step_start(ctx)
        cb.on_train_step_end(ctx)
    res = {"hooks_per_plain_step_s": (time.perf_counter() - t0) / 1000}
    res["hooks_plain_step_allgathers"] = counter.take()
    counter.restore()
    return res


def host_time_per_param() -> dict[str, Any]:
    """~10k small params: host-side cost per param of a refresh (one write kernel per param)."""
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    job, engine = prepared_job(64, 5000, micro_batch_size=2)
    n = sum(1 for _ in job.model[0].parameters())
    reset = between_evals(engine)

    with plain_quantizer():
        t_refresh = timeit(
            lambda: (engine.before_eval(gathered_fresh=False), engine.after_forced_sync()), reset
        )
        t_written = timeit(lambda: engine._writes().run(zero=False))
    # The engine's own host cost: the write-back loop with the quantizer doing nothing at all.
    orig = EmulatedMXFP8Tensor.quantize_
    EmulatedMXFP8Tensor.quantize_ = lambda self, values: None  # type: ignore[method-assign,assignment]
    try:
        t_engine = timeit(lambda: engine._writes().run(zero=False))
    finally:
        EmulatedMXFP8Tensor.quantize_ = orig  # type: ignore[method-assign]
    t_stage = timeit(engine.stage_main_params)
    t_restore = timeit(engine.step_started, reps=20)
    return {
        "params": n,
        "refresh_per_param_s": t_refresh / n,
        "write_back_per_param_s": t_written / n,
        "engine_loop_per_param_s": t_engine / n,
        "core_staging_per_param_s": t_stage / n,
        "restore_per_param_s": t_restore / n,
    }
