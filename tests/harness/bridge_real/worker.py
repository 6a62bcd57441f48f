"""One rank of a real Megatron-Bridge ``pretrain()`` run (spawned by ``testing.launcher.launch``).

The model is Bridge's ``GPTModelProvider`` with megatron-core's local layer spec. A pre-wrap hook
(``cfg.model.register_pre_wrap_hook``, the place a user's TE fp8 model init would act) turns the
attention and MLP weights into emulated MXFP8 params, or, in the reference mode, keeps them bf16
and applies the same MXFP8 rounding on the fly in forward (straight-through), with no fp8 param
gather: both runs then see identical weights at every step, so any loss difference is a defect.

What comes back (identical on every rank for the losses): train losses per step, eval losses per
step, the test loss, the bucket-offset mismatches before and after the callbacks' train start, the
sequence of callback events and forced param syncs, and the final weights.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.bridge_real.config import JobSpec, build_config
from harness.bridge_real.resume import dequantize_before_load, final_tensors, plant_band, resume_fix

MXFP8_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@dataclass
class RankResult:
    train_losses: dict[int, float] = field(default_factory=dict)
    #: (step, loss) of every validation run in order: the loop's evals, then pretrain's final one
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    test_loss: float | None = None
    mismatches_before: list[str] = field(default_factory=list)
    mismatches_after: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    #: params the pre-wrap hook turned into emulated MXFP8
    mxfp8_param_names: list[str] = field(default_factory=list)
    save_dir: str | None = None
    #: model chunks on this rank (virtual pipeline stages) and its pipeline rank
    num_chunks: int = 0
    pp_rank: int = 0
    #: model param name -> (buffer index, bucket index, start, end, shape) in the bucket, the
    #: layout of the distributed optimizer's per-bucket ``param`` tensors in a torch_dist checkpoint
    layout: dict[str, tuple[int, int, int, int, tuple[int, ...]]] = field(default_factory=dict)
    bridge_version: str = ""
    core_version: str = ""
    #: ``ddp.align_param_gather`` as Bridge resolved it (the interleaved schedule then dispatches
    #: every chunk's all-gather itself through ``config.param_sync_func``)
    align_param_gather: bool | None = None
    #: one entry per bucket group and forced sync, taken at the group's next all-gather wait: True
    #: when that wait gathers and copies back, False when it skips (defect C's mechanism)
    gathers_after_forced_sync: list[bool] = field(default_factory=list)
    #: wall seconds of this run's ``pretrain()`` on this rank (what each mode costs CI)
    wall_s: float = 0.0
    plugin_history: list[str] = field(default_factory=list)
    #: plugin runs: what each of the plugin's hook calls cost (``harness.bridge_real.costs``)
    plugin_costs: list[Any] = field(default_factory=list)
    #: ``record_final``: every tensor the params and main shards hold at train end (F's comparison)
    final: dict[str, Any] = field(default_factory=dict)


def _to_mxfp8(model: list[Any], names: list[str], plant: bool = False) -> list[Any]:
    from mbridge_mxfp8_plugin.testing import make_mxfp8_param

    for chunk in model:
        for name, module in list(chunk.named_modules()):
            w = module._parameters.get("weight") if hasattr(module, "_parameters") else None
            if w is None or not f"{name}.weight".endswith(MXFP8_WEIGHTS):
                continue
            new = make_mxfp8_param(plant_band(w.data) if plant else w.data)
            for k, v in w.__dict__.items():  # megatron's tensor-parallel attributes
                new.__dict__.setdefault(k, v)
            module._parameters["weight"] = new
            names.append(_strip(f"{name}.weight"))
    return model


def _quantize_on_the_fly(model: list[Any]) -> list[Any]:
    from mbridge_mxfp8_plugin.testing import mxfp8_reference_weight

    def wrap(module: Any) -> None:
        forward = module.forward

        def quantized_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            w = self._parameters["weight"]
            # The module reads self.weight; for one call it is the rounded value (the kit's
            # MXFP8_PARAM_KIND decides which copies), and the gradient reaches the real param.
            self._parameters["weight"] = mxfp8_reference_weight(w)
            try:
                return forward(*args, **kwargs)
            finally:
                self._parameters["weight"] = w

        module.forward = types.MethodType(quantized_forward, module)

    for chunk in model:
        for name, module in list(chunk.named_modules()):
            if "weight" in getattr(module, "_parameters", {}) and f"{name}.weight".endswith(MXFP8_WEIGHTS):
                wrap(module)
    return model


class _Recorder:
    """Registered after the plugin: records losses, events, and what the plugin left behind."""

    def __init__(self, result: RankResult, record_events: bool, record_final: bool = False) -> None:
        self.r, self.record_events, self.record_final = result, record_events, record_final

    def _ev(self, name: str) -> None:
        if self.record_events:
            self.r.events.append(name)

    def on_train_start(self, ctx: Any) -> None:

        self._ev("on_train_start")
        from megatron.core import parallel_state

        self.r.num_chunks = len(ctx.model)
        ddp = getattr(ctx.state.cfg, "ddp", None)  # the replica's state carries no DDP config
        self.r.align_param_gather = None if ddp is None else ddp.align_param_gather
        self.r.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        chunks = [c for c in ctx.model if hasattr(c, "buffers")]
        self.r.mismatches_after = _mismatches(chunks)
        if len(chunks) == 1:
            self.r.layout = _layout(chunks[0])

    def on_train_step_start(self, ctx: Any) -> None:
        self._ev("on_train_step_start")

    def on_train_step_end(self, ctx: Any) -> None:
        self._ev("on_train_step_end")
        loss = (ctx.loss_dict or {}).get("lm loss")
        if loss is not None:
            self.r.train_losses[ctx.state.train_state.step + 1] = float(loss)

    def on_train_end(self, ctx: Any) -> None:
        self._ev("on_train_end")
        if self.record_final:
            self.r.final = final_tensors(ctx.model, ctx.optimizer)

    def on_eval_start(self, ctx: Any) -> None:
        self._ev("on_eval_start")

    # on_eval_end / on_test_end alike on purpose (duplicates lists them): one record field each.
    def on_eval_end(self, ctx: Any) -> None:
        self._ev("on_eval_end")
        loss = (ctx.total_loss_dict or {}).get("lm loss")  # only the last pipeline stage has losses
        if loss is not None:
            self.r.eval_losses.append((ctx.state.train_state.step, float(loss)))

    def on_test_start(self, ctx: Any) -> None:
        self._ev("on_test_start")

    def on_test_end(self, ctx: Any) -> None:
        self._ev("on_test_end")
        loss = (ctx.total_loss_dict or {}).get("lm loss")
        if loss is not None:
            self.r.test_loss = float(loss)

    def on_checkpoint_save(self, ctx: Any) -> None:
        self._ev("on_checkpoint_save")


def _mismatches(chunks: list[Any]) -> list[str]:
    from mbridge_mxfp8_plugin import check_bucket_alignment

    return [str(m.param) for m in check_bucket_alignment(chunks, repair=False).mismatches]


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _layout(chunk: Any) -> dict[str, tuple[int, int, int, int, tuple[int, ...]]]:
    names = {p: _strip(n) for n, p in chunk.named_parameters()}
    out = {}
    for g, buffer in enumerate(chunk.buffers):
        for p, (start, end, bucket_id) in buffer.param_index_map.items():
            offset = buffer.buckets[bucket_id].offset
            out[names[p]] = (g, bucket_id, start - offset, end - offset, tuple(p.shape))
    return out


class _Aligner:
    """Plugin off, bucket offsets repaired at train start: B and C without A (mode ``aligned``)."""

    def on_train_start(self, ctx: Any) -> None:
        from mbridge_mxfp8_plugin import check_bucket_alignment

        check_bucket_alignment([c for c in ctx.model if hasattr(c, "buffers")], repair=True)


class _Probe:
    """Registered first: the bucket offsets megatron-core built, before any callback repairs them."""

    def __init__(self, result: RankResult) -> None:
        self.r = result

    def on_train_start(self, ctx: Any) -> None:

        chunks = [c for c in ctx.model if hasattr(c, "buffers")]
        self.r.mismatches_before = _mismatches(chunks)


def run_rank(specs: tuple[JobSpec, ...]) -> list[RankResult]:
    """Run the jobs one after the other in this rank process.

    Bridge's ``pretrain()`` ends by destroying megatron-core's global state (``_finish_train`` ->
    ``destroy_global_state``: microbatch calculator, model-parallel groups, rerun state machine)
    and leaves a process group it did not create alone, so consecutive calls are independent runs;
    sharing the process saves the ~40 s import of Bridge per mode.
    """
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    if os.environ.get("BRIDGE_REAL_HANG_DUMP_S"):  # debugging aid: where is a stuck rank?
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["BRIDGE_REAL_HANG_DUMP_S"]))
    from harness.bridge_cpu import bridge_on_cpu
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    with bridge_on_cpu(), emulated_mxfp8(), _dequantize_like_te2():
        return [_run_one(spec) for spec in specs]


@contextlib.contextmanager
def _dequantize_like_te2() -> Iterator[None]:
    """megatron-core's ``dequantize_fp8_tensor`` picks TE's API by TE version (``dequantize()``
    from TE 2.0, ``from_float8()`` before) and fails with no TE installed; checkpoint loads call it
    on every MXFP8 param. The emulated param implements TE 2's ``dequantize()``."""
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer

    def dequantize(t: torch.Tensor) -> torch.Tensor:
        return t.dequantize()

    mods = [m for m in (fp8_utils, distrib_optimizer) if hasattr(m, "dequantize_fp8_tensor")]
    saved = [m.dequantize_fp8_tensor for m in mods]
    for m in mods:
        m.dequantize_fp8_tensor = dequantize
    try:
        yield
    finally:
        for m, f in zip(mods, saved, strict=True):
            m.dequantize_fp8_tensor = f


@contextlib.contextmanager
def _recording_gathers_after_forced_syncs(out: list[bool]) -> Iterator[None]:
    """Defect C where it acts: a forced sync leaves ``param_gather_dispatched`` set and no handle,
    so the group's next ``finish_param_sync`` (the forward pre-hook's wait) neither gathers nor
    copies back. Appends, per group, whether that next wait gathers. The interleaved schedule
    with ``align_param_gather`` dispatches each chunk's gather itself (``param_sync_func``) before
    that wait, which is why C does not act there. Fresh per run: group ids are not reused across."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    start, finish = Group.start_param_sync, Group.finish_param_sync
    forced: set[int] = set()

    def start_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("force_sync", args[0] if args else False):
            forced.add(id(self))
        return start(self, *args, **kwargs)

    def finish_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self) in forced:
            forced.discard(id(self))
            out.append(self.param_gather_handle is not None or not self.param_gather_dispatched)
        return finish(self, *args, **kwargs)

    Group.start_param_sync, Group.finish_param_sync = start_param_sync, finish_param_sync  # type: ignore[method-assign]
    try:
        yield
    finally:
        Group.start_param_sync, Group.finish_param_sync = start, finish  # type: ignore[method-assign]


def _run_one(spec: JobSpec) -> RankResult:
    from importlib.metadata import version

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from harness.bridge_loop import recording_param_syncs
    from harness.bridge_real.costs import CostMeter
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback

    result = RankResult(
        bridge_version=version("megatron-bridge"),
        core_version=version("megatron-core"),
        save_dir=spec.save_dir,
    )
    cfg = build_config(spec, torch.distributed.get_world_size())
    if spec.mxfp8:
        cfg.model.register_pre_wrap_hook(
            lambda model: _to_mxfp8(model, result.mxfp8_param_names, spec.plant_band)
        )
    else:
        cfg.model.register_pre_wrap_hook(_quantize_on_the_fly)
    callbacks: list[Any] = [_Probe(result)]
    plugin = MXFP8ParamSyncCallback() if spec.mode == "plugin" else None
    meter = CostMeter()
    if plugin is not None:
        callbacks.append(meter.wrap(plugin))
    if spec.mode == "aligned":
        callbacks.append(_Aligner())
    callbacks.append(_Recorder(result, spec.record_events, spec.record_final))
    sink: list[str] = result.events if spec.record_events else []
    began = time.monotonic()
    with (
        meter.counting(),
        resume_fix(spec.resume_fix),
        dequantize_before_load(),
        recording_param_syncs(sink),
        _recording_gathers_after_forced_syncs(result.gathers_after_forced_sync),
    ):
        pretrain(cfg, forward_step, callbacks=callbacks)
    result.wall_s = time.monotonic() - began
    if plugin is not None:
        result.plugin_history = [e for e, _ in plugin.history]
        result.plugin_costs = meter.costs
    return result
