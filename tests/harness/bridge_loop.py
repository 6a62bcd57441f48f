"""A faithful replica of Megatron-Bridge's train/eval loop order, firing Bridge's real callbacks.

Bridge's own ``pretrain()`` runs in the tests too (``tests/bridge_real/test_bridge_real.py``, on CPU through
``harness.bridge_cpu``), and ``test_replica_loop_makes_the_same_calls_as_real_pretrain`` checks, for
every Bridge release CI covers, that this replica and the real loop make the same calls in the same
order (callback events, pre-hook toggles, forced syncs, main-param staging; recorded by
:func:`recording_param_syncs`). The replica is kept for what the real loop cannot do here, or
not in seconds: loop orders of Bridge releases on megatron-core releases they do not install with
(core 0.14 / 0.15 and the "other pairs" of docs/compatibility.md); schedules placed exactly on an
iteration (SIGTERM and exit-duration saves, async-save finalization, weight-hash checks, an
exception inside eval, eval-only jobs); the toy layouts of docs/robustness.md (MoE EP=2, several
optimizer instances, frozen/tied/odd-sized params) and the 200-step soak, each a fraction of a
second per mode where a real ``pretrain()`` costs ~40 s of imports; and ``mxfp8-plugin demo``,
which must run without Bridge's dependency tree.

The order in which Bridge's ``train()`` toggles forward pre-hooks, stages main params, forces param
syncs and fires callbacks is what decides whether MXFP8 weights are right. This module reproduces
that order line for line
for megatron-bridge 0.3.1 (the default), 0.4.2, 0.5.1 and 0.6.2 (``train(..., loop="0.5.1")``;
:class:`LoopOrder` lists what differs, with references to each release's
``megatron/bridge/training/{train,eval,pretrain,checkpointing}.py``) around a toy forward/backward,
and fires events through the real ``CallbackManager`` loaded by file path from the installed
megatron-bridge wheel (:func:`load_bridge_callbacks`; callbacks.py is byte-identical in 0.3.1/0.4.2
and in 0.5.1/0.6.2). :func:`evaluate_only` is pretrain's ``skip_train`` path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.megatron_lm_loop import dp_mean
from mbridge_mxfp8_plugin.testing.toy import Job, make_batches

from .weights import RunRecord, weights_of

__all__ = [
    "LOOP_ORDERS",
    "LoopOrder",
    "LoopSchedule",
    "BridgeLoopRun",
    "evaluate_only",
    "find_bridge_file",
    "load_bridge_callbacks",
    "loop_order",
    "recording_param_syncs",
    "run_api_with_staging_loop",
    "train",
]


@contextlib.contextmanager
def recording_param_syncs(events: list[str]) -> Iterator[list[str]]:
    """Append to ``events`` every pre-hook toggle, forced param sync and main-param staging.

    Instruments megatron-core's classes, not a loop, so the very same record comes out of this
    replica and of Bridge's real ``train()``: ``disable_pre_hooks`` / ``enable_pre_hooks``
    (``DistributedDataParallel.{disable,enable}_forward_pre_hook``), ``force_sync``
    (``start_param_sync(force_sync=True)``, also the one inside a disable) and ``stage``
    (``DistributedOptimizer._copy_main_params_to_param_buffer``, whoever calls it: the loop's
    per-step copy, Bridge 0.5's pre-eval staging, core 0.19's ``prepare_model_params_for_param_sync``
    or the plugin). Combined with a callback that logs its events, two loops that produce the same
    list made the same calls in the same order.
    """
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistOpt

    originals = {
        (DDP, "disable_forward_pre_hook"): DDP.disable_forward_pre_hook,
        (DDP, "enable_forward_pre_hook"): DDP.enable_forward_pre_hook,
        (DDP, "start_param_sync"): DDP.start_param_sync,
        (DistOpt, "_copy_main_params_to_param_buffer"): DistOpt._copy_main_params_to_param_buffer,
    }

    def disable(self: Any, *args: Any, **kwargs: Any) -> Any:
        param_sync = kwargs.get("param_sync", args[0] if args else True)
        events.append("disable_pre_hooks" if param_sync else "disable_pre_hooks(no_sync)")
        return originals[(DDP, "disable_forward_pre_hook")](self, *args, **kwargs)

    def enable(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("enable_pre_hooks")
        return originals[(DDP, "enable_forward_pre_hook")](self, *args, **kwargs)

    def start_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("force_sync", False):
            events.append("force_sync")
        return originals[(DDP, "start_param_sync")](self, *args, **kwargs)

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("stage")
        return originals[(DistOpt, "_copy_main_params_to_param_buffer")](self, *args, **kwargs)

    replacements = {
        (DDP, "disable_forward_pre_hook"): disable,
        (DDP, "enable_forward_pre_hook"): enable,
        (DDP, "start_param_sync"): start_param_sync,
        (DistOpt, "_copy_main_params_to_param_buffer"): stage,
    }
    for (cls, name), fn in replacements.items():
        setattr(cls, name, fn)
    try:
        yield events
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)


def find_bridge_file(relative: str = "training/callbacks.py") -> Path:
    """Locate a file of the installed megatron-bridge distribution without importing the package."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / "bridge" / relative
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"megatron/bridge/{relative} not found; install the wheel without its dependencies: "
        "pip install --no-deps megatron-bridge==0.3.1"
    )


def load_bridge_callbacks(path: str | Path | None = None) -> ModuleType:
    """Load ``megatron/bridge/training/callbacks.py`` by file path (it needs only the stdlib)."""
    file = Path(path) if path else find_bridge_file()
    name = "_bridge_callbacks_" + str(abs(hash(str(file))))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class LoopSchedule:
    """When the loop evaluates and saves; mirrors the ``cfg.train`` / ``cfg.checkpoint`` knobs."""

    train_iters: int = 9
    eval_interval: int = 3
    eval_iters: int = 2
    save_interval: int | None = None
    num_microbatches: int = 1
    #: ``cfg.train.check_weight_hash_across_dp_replicas_interval``: a forced sync with no callback.
    weight_hash_interval: int | None = None
    #: ``cfg.checkpoint.non_persistent_save_interval`` (the ``elif`` after the regular save).
    non_persistent_save_interval: int | None = None
    #: ``cfg.train.exit_interval``: save (when saving is on) and leave the loop at these steps.
    exit_interval: int | None = None
    #: SIGTERM reaches every rank during this iteration (0-based), i.e. before its
    #: ``on_train_step_end``; ``cfg.train.exit_signal_handler`` is on whenever this is set.
    signal_at_iteration: int | None = None
    #: ``cfg.train.exit_duration_in_mins`` runs out during this iteration (0-based).
    exit_duration_at_iteration: int | None = None
    #: ``cfg.checkpoint.save`` without any interval: only exit/end-of-run saves.
    save_on_exit: bool = False
    #: ``cfg.checkpoint.async_save``: Bridge >= 0.5 fires ``on_checkpoint_save`` when the save is
    #: finalized, at the top of a later iteration or after the closing disable (0.5.1 L359/L767).
    async_save: bool = False

    @property
    def saves(self) -> bool:
        return bool(self.save_interval or self.non_persistent_save_interval or self.save_on_exit)


@dataclass
class BridgeLoopRun(RunRecord):
    """A :class:`~harness.weights.RunRecord` plus what the loop did, for the order tests."""

    #: callbacks fired and forced syncs issued, in order
    events: list[str] = field(default_factory=list)
    #: weights seen by the weight-hash check, by step
    hashed_weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Loop orders. Line numbers: megatron/bridge/training/{train,eval,pretrain,checkpointing}.py of the
# release named; "0.3.1 L227" means train.py line 227 of megatron-bridge 0.3.1 unless a file is named.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopOrder:
    """What differs between Bridge releases around forced param syncs and callbacks."""

    release: str
    #: on_train_start fires before the initial ``disable_forward_pre_hook(param_sync=False)``
    #: (0.4.2 L266 vs L282; 0.5.1 L323/L339; 0.6.2 L349/L368) instead of after it (0.3.1 L227/L270).
    on_train_start_before_disable: bool
    #: eval interval read from ``cfg.validation`` (0.4+: ``val_config = config.validation``,
    #: 0.4.2 L130) instead of ``cfg.train`` (0.3.1 L503).
    validation_config: bool
    #: 0.5.1 L646-653: before the eval's forced sync, ``zero_grad_buffer()`` on every chunk and
    #: ``_copy_main_params_to_param_buffer()`` on every DistributedOptimizer (evals only).
    stage_before_eval: bool
    #: 0.6.2 L1145-1173: ``disable_forward_pre_hook(model, optimizer=...)`` and
    #: ``force_param_sync(model, optimizer=...)`` call ``optimizer.prepare_model_params_for_param_sync()``
    #: first: evals (L669), saves (L1321), weight-hash checks (L1087), the closing disable (L777).
    optimizer_prepares_sync: bool
    #: 0.6.2 eval.py: on_eval_start after ``model.eval()`` (L109/L111) and on_eval_end before
    #: ``model.train()`` (L371/L384), both inside ``evaluate()``; earlier releases fire them in
    #: ``evaluate_and_print_results`` around the ``evaluate()`` call (0.3.1 eval.py L320/L377).
    eval_events_inside_evaluate: bool
    #: on_checkpoint_save at the end of ``checkpointing.save_checkpoint`` (0.5.1 checkpointing.py
    #: L1243-1261, 0.6.2 L1548-1566), i.e. after the forced sync and the write.
    fires_on_checkpoint_save: bool
    #: 0.4+: the final save (last step not saved by the interval) is ``save_checkpoint_and_time`` inside
    #: ``train()`` before the closing disable (0.4.2 L606, 0.5.1 L742, 0.6.2 L757). 0.3.1 saves in
    #: pretrain.py L158 with ``save_checkpoint`` directly (no forced sync), after ``train()`` returned.
    final_save_in_train: bool
    #: 0.4+: ``save_checkpoint_and_time`` calls ``free_overlap_buffers()`` after the forced sync
    #: (0.4.2 L1143-1146).
    frees_overlap_buffers: bool


LOOP_ORDERS: dict[str, LoopOrder] = {
    "0.3.1": LoopOrder("0.3.1", False, False, False, False, False, False, False, False),
    "0.4.2": LoopOrder("0.4.2", True, True, False, False, False, False, True, True),
    "0.5.1": LoopOrder("0.5.1", True, True, True, False, False, True, True, True),
    "0.6.2": LoopOrder("0.6.2", True, True, False, True, True, True, True, True),
}
DEFAULT_LOOP = "0.3.1"


def loop_order(loop: str | LoopOrder | None = None) -> LoopOrder:
    """``"0.5.1"``, ``"0.5"`` (any 0.5.x) or a :class:`LoopOrder`; ``None`` is Bridge 0.3.1."""
    if isinstance(loop, LoopOrder):
        return loop
    key = (loop or DEFAULT_LOOP).strip().lstrip("v")
    if key in LOOP_ORDERS:
        return LOOP_ORDERS[key]
    minor = ".".join(key.split(".")[:2])
    for release, order in LOOP_ORDERS.items():
        if release.startswith(minor + "."):
            return order
    raise ValueError(
        f"unknown Megatron-Bridge loop order {loop!r}; known: {sorted(LOOP_ORDERS)} (or their X.Y)"
    )


def replica_release(installed: str) -> str:
    """The replica's order for an installed Bridge release: its own, or the newest the replica
    knows for a newer Bridge (main, 0.7.0-dev), which the callers then hold to that order."""
    newest = max(LOOP_ORDERS, key=lambda r: tuple(map(int, r.split("."))))
    minor = tuple(map(int, installed.split("+")[0].split(".")[:2]))
    return newest if minor > tuple(map(int, newest.split(".")[:2])) else installed


def _make_state(schedule: LoopSchedule, order: LoopOrder | None = None) -> Any:
    """The slice of Bridge's ``GlobalState`` that callbacks read (``state.cfg``, ``state.train_state``)."""
    order = order or loop_order()
    train = SimpleNamespace(
        train_iters=schedule.train_iters,
        # 0.4+: deprecated copies, None unless set (0.4.2 config.py L549-552).
        eval_interval=None if order.validation_config else schedule.eval_interval,
        eval_iters=None if order.validation_config else schedule.eval_iters,
        exit_interval=schedule.exit_interval,
        exit_signal_handler=schedule.signal_at_iteration is not None,
        exit_duration_in_mins=None if schedule.exit_duration_at_iteration is None else _EXIT_DURATION_MINS,
        skip_train=False,
    )
    ckpt = SimpleNamespace(
        save="/tmp/replica" if schedule.saves else None,
        save_interval=schedule.save_interval,
        non_persistent_save_interval=schedule.non_persistent_save_interval,
        async_save=schedule.async_save,
    )
    cfg = SimpleNamespace(train=train, checkpoint=ckpt)
    if order.validation_config:
        cfg.validation = SimpleNamespace(
            eval_interval=schedule.eval_interval,
            eval_iters=schedule.eval_iters,
            start_eval_at_iter=None,
            skip_train=False,
        )
    return SimpleNamespace(
        cfg=cfg,
        train_state=SimpleNamespace(step=0, do_valid=True, do_test=False),
        start_time=time.time(),  # GlobalState.start_time (0.3.1 state.py L133)
        # GlobalState._signal_handler (lazily built by the signal_handler property, 0.3.1 L327-331)
        _signal_handler=_SignalHandler() if schedule.signal_at_iteration is not None else None,
        # finalize functions of async saves not yet finalized (AsyncRequest.add_finalize_fn)
        async_pending=[] if schedule.async_save else None,
    )


def _finalize_async_saves(state: Any, record: BridgeLoopRun) -> None:
    """``checkpoint_manager.finalize_async_saves`` (0.5.1 L359 non-blocking at the top of each
    iteration, L767/L783 blocking after the closing disable; 0.6.2 L389/L782/L798): the write is
    taken to have finished by the next call, so every queued finalize function runs there."""
    pending = state.async_pending
    while pending:
        pending.pop(0)()
        record.events.append("finalize_async_save")


_EXIT_DURATION_MINS = 60.0


class _SignalHandler:
    """``DistributedSignalHandler`` (utils/sig_utils.py, 0.3.1 L93-141): the handler sets a local
    flag; ``signals_received()`` all-gathers it (a real collective, as in Bridge)."""

    def __init__(self) -> None:
        self._signal_received = False

    def signals_received(self) -> list[bool]:
        flag = torch.tensor([int(self._signal_received)], dtype=torch.int32, device="cuda")
        out = [torch.zeros_like(flag) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(out, flag)
        return [bool(t.item()) for t in out]


# -- train.py helpers (0.3.1: L935-966; 0.6.2: L1134-1173) ------------------------------------
def enable_forward_pre_hook(model: list[Any]) -> None:
    for chunk in model:
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True, *, optimizer: Any = None) -> None:
    """0.3.1 L946-955; with ``optimizer`` the 0.6.2 variant (L1145-1159) that stages first."""
    if param_sync and optimizer is not None:
        optimizer.prepare_model_params_for_param_sync()
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def force_param_sync(model: list[Any], optimizer: Any = None) -> None:
    """0.3.1 L958-966; with ``optimizer`` the 0.6.2 variant (L1162-1173) that stages first."""
    if optimizer is not None:
        optimizer.prepare_model_params_for_param_sync()
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def _bridge_train_module(order: LoopOrder) -> ModuleType:
    """A stand-in for ``megatron.bridge.training.train`` exposing that release's helper signatures.

    The plugin recognises a loop that stages main params before every forced sync (0.6+) from the
    signatures of the loaded Bridge ``train`` module's ``force_param_sync`` /
    ``disable_forward_pre_hook`` (see :func:`mbridge_mxfp8_plugin.upstream.probe_live_bridge_loop`).
    """
    mod = ModuleType("megatron.bridge.training.train")
    mod.__dict__["__replica_release__"] = order.release
    mod.__dict__["enable_forward_pre_hook"] = enable_forward_pre_hook
    if order.optimizer_prepares_sync:

        def disable_hooks(model: list[Any], optimizer: Any = None, param_sync: bool = True) -> None:
            disable_forward_pre_hook(model, param_sync, optimizer=optimizer)

        def force_sync(model: list[Any], optimizer: Any = None) -> None:
            force_param_sync(model, optimizer)
    else:

        def disable_hooks(model: list[Any], param_sync: bool = True) -> None:  # type: ignore[misc]
            disable_forward_pre_hook(model, param_sync)

        def force_sync(model: list[Any]) -> None:  # type: ignore[misc]
            force_param_sync(model)

    mod.__dict__["disable_forward_pre_hook"] = disable_hooks
    mod.__dict__["force_param_sync"] = force_sync
    return mod


def _handle_mxfp8_param_buffer_copy(optimizer: Any, model: list[Any], reuse: bool, overlap: bool) -> None:
    """train.py 0.3.1 L1350-1380 (0.6.2 L1613-1649 adds full-iteration CUDA graphs only): stage main
    params into the shared buffer, only with pre-hooks on."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if reuse and overlap:
        if len(model[0].remove_forward_pre_hook_handles) > 0:
            for opt in optimizer.chained_optimizers:
                if isinstance(opt, DistributedOptimizer):
                    opt._copy_main_params_to_param_buffer()


def train_step(job: Job, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """train.py ``train_step`` (0.3.1 L639-720, 0.6.2 L824-) with megatron-core's no-pipelining
    schedule inlined. The order inside is the same in every release (0.3.1 L680-690, 0.4.2 L713-723,
    0.5.1 L850-860, 0.6.2 L866-876)."""
    model, optimizer = job.model, job.optimizer
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    _handle_mxfp8_param_buffer_copy(
        optimizer,
        model,
        job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag,
        job.ddp_config.overlap_param_gather,
    )
    # forward_backward_no_pipelining: no_sync for all but the last microbatch, then
    # finalize_model_grads -> finish_grad_sync on every chunk.
    losses = []
    for i, (x, y) in enumerate(batches):
        ctx = model[0].no_sync() if i < len(batches) - 1 else _null()
        with ctx:
            loss = model[0](x, y)
            (loss / len(batches)).backward()
        losses.append(loss.detach())
    for chunk in model:
        chunk.finish_grad_sync()
    optimizer.step()
    return dp_mean(torch.stack(losses).mean())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def evaluate_and_print_results(
    job: Job,
    manager: Any,
    callbacks_mod: ModuleType,
    state: Any,
    eval_batches: list[Any],
    *,
    is_test: bool = False,
    loop: str | LoopOrder | None = None,
    record: BridgeLoopRun | None = None,
) -> float:
    """eval.py ``evaluate_and_print_results`` + ``evaluate`` (0.3.1 L278-386 / L42-275).

    Eval and test contexts carry no optimizer in any release. Where the start/end events fire
    relative to ``model.eval()`` / ``model.train()`` depends on the release (see :class:`LoopOrder`).
    """
    order = loop_order(loop)
    start, end = ("on_test_start", "on_test_end") if is_test else ("on_eval_start", "on_eval_end")
    ctx = callbacks_mod.CallbackContext

    def fire(event: str, **extra: Any) -> None:
        if callbacks_mod.should_fire(manager, event):
            manager.fire(event, ctx(state=state, model=job.model, user_state=manager.user_state, **extra))
            if record is not None:
                record.events.append(event)

    if not order.eval_events_inside_evaluate:
        fire(start)  # 0.3.1 eval.py L320 (0.4.2 L343, 0.5.1 L412): before evaluate()
    for chunk in job.model:  # evaluate(): 0.3.1 L86-87, 0.6.2 L108-109
        chunk.eval()
    if order.eval_events_inside_evaluate:
        fire(start)  # 0.6.2 eval.py L111: after model.eval()
    losses = []
    with torch.no_grad():
        for x, y in eval_batches:
            losses.append(job.model[0](x, y))
    loss = dp_mean(torch.stack(losses).mean())
    if order.eval_events_inside_evaluate:
        fire(end, total_loss_dict={"lm loss": loss})  # 0.6.2 eval.py L371: before model.train()
    for chunk in job.model:  # 0.3.1 L263-264, 0.6.2 L383-384
        chunk.train()
    if not order.eval_events_inside_evaluate:
        fire(end, total_loss_dict={"lm loss": loss})  # 0.3.1 eval.py L377: after evaluate() returned
    return loss


def _save(
    job: Job,
    order: LoopOrder,
    fire: Any,
    record: BridgeLoopRun,
    key: int,
    *,
    forced: bool = True,
    pending: list[Any] | None = None,
) -> None:
    """``save_checkpoint_and_time`` (0.3.1 L1055-1127, 0.4.2 L1092, 0.5.1 L1241-1331, 0.6.2 L1269-1359).

    No callback before the write in any release; the pre-hooks stay enabled. ``forced=False`` is
    0.3.1's end-of-run ``save_checkpoint`` in pretrain.py L158, which does not force a sync.
    """
    model = job.model
    toggle = bool(job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather)
    if forced and toggle:
        # 0.3.1 L1101-1102 / 0.6.2 L1320-1321 (optimizer=optimizer: stages first)
        force_param_sync(model, job.optimizer if order.optimizer_prepares_sync else None)
        record.events.append("force_param_sync")
    if forced and order.frees_overlap_buffers:  # 0.4.2 L1143-1146
        for chunk in model:
            if hasattr(chunk, "free_overlap_buffers"):
                chunk.free_overlap_buffers()
    record.saved_weights[key] = weights_of(model)  # what dist-checkpointing writes: param.data
    if order.fires_on_checkpoint_save:  # 0.5.1 checkpointing.py L1243-1261 (sync save)
        # save_checkpoint unwrapped the model first (0.6.2 checkpointing.py L1120): the context
        # carries the bare modules, not the DDP chunks the other events carry.
        from megatron.core.utils import unwrap_model

        bare = unwrap_model(list(model))
        if pending is None:
            fire("on_checkpoint_save", optimizer=job.optimizer, model=bare)
        else:  # async: add_finalize_fn(fire_callback), L1258
            pending.append(lambda: fire("on_checkpoint_save", optimizer=job.optimizer, model=bare))


def _checkpoint_and_decide_exit(
    job: Job, order: LoopOrder, fire: Any, record: BridgeLoopRun, state: Any
) -> bool:
    """``checkpoint_and_decide_exit`` (0.3.1 L1130-1263, 0.6.2 L1362-1500; same branches in all four):
    signal -> save + exit; regular save, elif non-persistent save; duration -> save unless saved +
    exit; exit_interval -> save unless saved + exit. Every save is ``save_checkpoint_and_time``."""
    train, ckpt, step = state.cfg.train, state.cfg.checkpoint, state.train_state.step

    def save() -> None:
        _save(job, order, fire, record, step, pending=state.async_pending)

    if train.exit_signal_handler and any(state._signal_handler.signals_received()):
        if ckpt.save:
            save()
        return True
    saved = False
    if ckpt.save and ckpt.save_interval and step % ckpt.save_interval == 0:
        save()
        saved = True
    elif ckpt.save and ckpt.non_persistent_save_interval and step % ckpt.non_persistent_save_interval == 0:
        save()
        saved = True
    if train.exit_duration_in_mins:
        over = (time.time() - state.start_time) / 60.0 > train.exit_duration_in_mins
        done = torch.tensor([int(over)], dtype=torch.int, device="cuda")
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        if done.item():
            if ckpt.save and not saved:
                save()
            return True
    if train.exit_interval and step % train.exit_interval == 0:
        if ckpt.save and not saved:
            save()
        return True
    return False


def train(
    job: Job,
    schedule: LoopSchedule,
    callbacks: list[Any] | None = None,
    *,
    callbacks_module: ModuleType | None = None,
    run_test: bool = False,
    loop: str | LoopOrder | None = None,
    run_valid: bool = False,
) -> BridgeLoopRun:
    """train.py ``train()`` (+ pretrain.py's closing evals) of the given Bridge release, in its order.

    ``loop`` picks the release (``"0.3.1"`` default, ``"0.4.2"``, ``"0.5.1"``, ``"0.6.2"`` or X.Y).
    Line references: 0.3.1 L87-637 | 0.4.2 L91-670 | 0.5.1 L113-805 | 0.6.2 L125-820.
    ``schedule.save_interval`` adds interval saves and the release's end-of-run save
    (``record.saved_weights[step]`` / ``[-1]``); ``schedule.weight_hash_interval`` adds the
    weight-hash check (forced sync without a callback).
    """
    order = loop_order(loop)
    cb = callbacks_module or load_bridge_callbacks()
    manager = cb.CallbackManager()
    if callbacks:
        manager.add(callbacks)  # what pretrain(..., callbacks=[...]) does via normalize_callbacks
    ctx = cb.CallbackContext
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = _make_state(schedule, order)
    model, optimizer = job.model, job.optimizer
    record = BridgeLoopRun()
    eval_batches = make_batches(job.toy, schedule.eval_iters, rank=rank, world=world, salt=99991)
    stage_opt = optimizer if order.optimizer_prepares_sync else None
    hash_interval = getattr(schedule, "weight_hash_interval", None)

    def fire(event: str, **extra: Any) -> None:
        if cb.should_fire(manager, event):
            extra.setdefault("model", model)
            manager.fire(event, ctx(state=state, user_state=manager.user_state, **extra))
            record.events.append(event)

    saved_modules = {k: sys.modules.get(k) for k in (_TRAIN_MODULE,)}
    sys.modules[_TRAIN_MODULE] = _bridge_train_module(order)
    try:
        # should_disable_forward_pre_hook (0.3.1 L912): not fsdp and distopt and overlap.
        toggle = bool(job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather)
        pre_hook_enabled = True
        if order.on_train_start_before_disable:
            fire("on_train_start", optimizer=optimizer)  # 0.4.2 L266, 0.5.1 L323, 0.6.2 L349
        if toggle:  # 0.3.1 L226-232, 0.4.2 L281-287, 0.5.1 L338-344, 0.6.2 L364-372 (fresh run)
            disable_forward_pre_hook(model, param_sync=False)
            record.events.append("disable_forward_pre_hook(param_sync=False)")
            pre_hook_enabled = False
        if not order.on_train_start_before_disable:
            fire("on_train_start", optimizer=optimizer)  # 0.3.1 L270-279
        start_iteration = state.train_state.step
        should_exit = False
        while state.train_state.step < schedule.train_iters:
            it = state.train_state.step
            _finalize_async_saves(state, record)
            fire("on_train_step_start", optimizer=optimizer)  # 0.3.1 L351, 0.6.2 L454
            batches = make_batches(job.toy, schedule.num_microbatches, rank=rank, world=world, salt=it)
            record.train_losses.append(train_step(job, batches))
            if it == schedule.signal_at_iteration:  # SIGTERM arrives while the step runs
                state._signal_handler._signal_received = True
            if it == schedule.exit_duration_at_iteration:  # the time budget runs out during the step
                state.start_time = time.time() - 60.0 * _EXIT_DURATION_MINS - 1.0
            fire("on_train_step_end", optimizer=optimizer)  # 0.3.1 L385, 0.6.2 L497
            if it == start_iteration and toggle and not pre_hook_enabled:  # 0.3.1 L419-436, 0.6.2 L535-549
                enable_forward_pre_hook(model)
                pre_hook_enabled = True
            state.train_state.step += 1  # 0.3.1 L445
            step = state.train_state.step
            if schedule.eval_interval and step % schedule.eval_interval == 0:
                # 0.3.1 L501-540 | 0.4.2 L512-549 | 0.5.1 L635-684 | 0.6.2 L657-698
                if (
                    order.stage_before_eval
                    and job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag
                    and (job.ddp_config.overlap_param_gather)
                ):
                    _stage_like_bridge_051(job)  # 0.5.1 L646-653
                    record.events.append("stage_main_params(0.5)")
                if toggle:
                    disable_forward_pre_hook(model, optimizer=stage_opt)  # forced all-gather before eval
                    record.events.append("disable_forward_pre_hook")
                    pre_hook_enabled = False
                record.eval_losses[step] = evaluate_and_print_results(
                    job, manager, cb, state, eval_batches, loop=order, record=record
                )
                if toggle:
                    enable_forward_pre_hook(model)
                    pre_hook_enabled = True
            if hash_interval and step % hash_interval == 0:
                # maybe_check_weight_hash_across_dp_replicas: 0.3.1 L868-896, 0.6.2 L1065-1095
                if toggle:
                    disable_forward_pre_hook(model, optimizer=stage_opt)
                    record.events.append("disable_forward_pre_hook(hash)")
                record.hashed_weights[step] = weights_of(model)
                if toggle:
                    enable_forward_pre_hook(model)
            should_exit = _checkpoint_and_decide_exit(job, order, fire, record, state)
            if should_exit:
                break
        # End-of-run save when training completed normally and the last step was not saved
        # (0.4.2 L595-613, 0.5.1 L733-751, 0.6.2 L749-770).
        ckpt = state.cfg.checkpoint
        if (
            order.final_save_in_train
            and not should_exit
            and ckpt.save
            and state.train_state.step != 0
            and ckpt.save_interval != 0
            and (ckpt.save_interval is None or state.train_state.step % ckpt.save_interval != 0)
        ):
            _save(job, order, fire, record, -1, pending=state.async_pending)
        if pre_hook_enabled:  # 0.3.1 L594-595, 0.6.2 L776-777 (optimizer=optimizer)
            disable_forward_pre_hook(model, optimizer=stage_opt)
            record.events.append("disable_forward_pre_hook(final)")
        _finalize_async_saves(state, record)  # blocking, before on_train_end / sys.exit
        if should_exit:  # 0.3.1 L613-624, 0.6.2 L795-805: sys.exit before on_train_end
            record.events.append("sys.exit")
            record.final_weights = weights_of(model)
            return record
        fire("on_train_end", optimizer=optimizer)  # 0.3.1 L626, 0.4.2 L658, 0.5.1 L795, 0.6.2 L810
    finally:
        for k, v in saved_modules.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    # pretrain.py 0.3.1 L157-166: end-of-run save_checkpoint, no forced sync, after train().
    ckpt = state.cfg.checkpoint
    step = state.train_state.step
    if not order.final_save_in_train and ckpt.save and step != 0 and ckpt.save_interval != 0:
        _save(job, order, fire, record, -1, forced=False)
    if run_valid:  # pretrain.py (0.3.1 L175-187, 0.6.2 L171-182): validation after train(), no toggling
        record.eval_losses[-2] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, loop=order, record=record
        )
    if run_test:  # pretrain.py (0.3.1 L190-201): test evaluation after train(), no hook toggling
        record.eval_losses[-1] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, is_test=True, loop=order, record=record
        )
    record.final_weights = weights_of(model)
    return record


def evaluate_only(
    job: Job,
    schedule: LoopSchedule,
    callbacks: list[Any] | None = None,
    *,
    callbacks_module: ModuleType | None = None,
    run_test: bool = False,
    loop: str | LoopOrder | None = None,
) -> BridgeLoopRun:
    """pretrain.py with ``skip_train`` (0.3.1 L141/L175-201, 0.6.2 L148-197): no ``train()`` at all.

    Deliberately :func:`train`'s signature (duplicates lists the pair): scenarios call either one.
    The forward pre-hooks stay enabled as ``DistributedDataParallel.__init__`` left them, nothing
    stages main params, and no callback ever sees the optimizer. ``record.eval_losses[0]`` is the
    validation loss, ``[-1]`` the test loss.
    """
    order = loop_order(loop)
    cb = callbacks_module or load_bridge_callbacks()
    manager = cb.CallbackManager()
    if callbacks:
        manager.add(callbacks)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = _make_state(schedule, order)
    if order.validation_config:
        state.cfg.validation.skip_train = True
    else:
        state.cfg.train.skip_train = True
    record = BridgeLoopRun()
    eval_batches = make_batches(job.toy, schedule.eval_iters, rank=rank, world=world, salt=99991)
    record.eval_losses[0] = evaluate_and_print_results(
        job, manager, cb, state, eval_batches, loop=order, record=record
    )
    if run_test:
        record.eval_losses[-1] = evaluate_and_print_results(
            job, manager, cb, state, eval_batches, is_test=True, loop=order, record=record
        )
    record.final_weights = weights_of(job.model)
    return record


_TRAIN_MODULE = "megatron.bridge.training.train"


def _stage_like_bridge_051(job: Job) -> None:
    """0.5.1 train.py L646-653, verbatim order: zero every grad buffer, then stage each DistOpt."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for chunk in job.model:
        chunk.zero_grad_buffer()
    for opt in job.optimizer.chained_optimizers:
        if isinstance(opt, DistributedOptimizer):
            opt._copy_main_params_to_param_buffer()


# ---------------------------------------------------------------------------------------------
# The loop API (``mxfp8_param_sync``) in a loop that stages before every forced sync itself.
_STAGING_ITERS, _STAGING_EVAL_EVERY, _STAGING_SAVE_EVERY = 6, 2, 3


def _staging_step(job: Any, x: Any, y: Any) -> None:
    """One training step in core_v0.19's order: zero, stage (while pre-hooks are on), forward,
    backward, grad sync, optimizer step."""
    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    if len(job.model[0].remove_forward_pre_hook_handles) > 0:
        job.optimizer.prepare_model_params_for_param_sync()
    loss = job.model[0](x, y)
    loss.backward()
    for chunk in job.model:
        chunk.finish_grad_sync()
    job.optimizer.step()


def _staging_rank() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from harness.bridge_real.costs import CostMeter
    from mbridge_mxfp8_plugin import mxfp8_param_sync
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import evaluate as eval_forwards
    from mbridge_mxfp8_plugin.testing.toy import ToyConfig, build_job

    saved = sys.modules.get(_TRAIN_MODULE)
    sys.modules[_TRAIN_MODULE] = _bridge_train_module(loop_order("0.6.2"))
    meter = CostMeter()
    try:
        with cpu_shim(), emulated_mxfp8(), meter.counting():
            job = build_job(ToyConfig())
            model, opt = job.model, job.optimizer
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            evals = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
            sync = meter.measure("mxfp8_param_sync", 0, model, lambda: mxfp8_param_sync(model, opt))

            def call(name: str, step: int) -> None:
                meter.measure(name, step, model, getattr(sync, name))

            def evaluate(step: int) -> None:
                disable_forward_pre_hook(model, optimizer=opt)
                call("before_eval", step)
                eval_forwards(job, evals)
                enable_forward_pre_hook(model)
                call("after_eval", step)

            for step in range(1, _STAGING_ITERS + 1):
                call("step_started", step)
                ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=step)
                _staging_step(job, x, y)
                if step % _STAGING_EVAL_EVERY == 0:
                    evaluate(step)
                if step % _STAGING_SAVE_EVERY == 0:
                    call("before_save", step)
                    force_param_sync(model, opt)
            disable_forward_pre_hook(model, optimizer=opt)  # the closing forced sync
            call("close", _STAGING_ITERS)
            enable_forward_pre_hook(model)
            evaluate(_STAGING_ITERS)  # a test eval after training
            passive = bool(sync.engine is not None and sync.engine.passive)
    finally:
        if saved is None:
            sys.modules.pop(_TRAIN_MODULE, None)
        else:
            sys.modules[_TRAIN_MODULE] = saved
    return {"passive": passive, "costs": meter.costs}


def run_api_with_staging_loop(world_size: int = 2) -> list[dict[str, Any]]:
    """Per rank: whether the API's engine judged itself passive, and each call's cost.
    The loop API (``mxfp8_param_sync``) in a loop that stages before every forced sync itself.

    Megatron-LM core_v0.19 and Megatron-Bridge 0.6 call ``optimizer.prepare_model_params_for_param_sync()``
    before each step's forwards and before every forced param sync (the eval's pre-hook disable, a
    save's ``force_param_sync``, the closing disable); megatron-core 0.19 writes forced gathers back
    and resets the dispatch state. On such a pair every API call must cost nothing. The loop is the
    toy model's, with this module's helpers (0.6.2 signatures) and that release's ``train``
    module stand-in loaded, which is how the plugin recognises a staging loop.

    Schedule: 6 steps, evals after 2, 4 and 6, a save after 3 and the final one after 6, the closing
    disable, then a test eval. Each API call is measured by ``harness.bridge_real.costs.CostMeter``.
    """
    from mbridge_mxfp8_plugin.testing.launcher import launch

    return launch(_staging_rank, world_size)
