"""A real ``lightning.pytorch.Trainer`` driving megatron-core DDP + distributed optimizer, NeMo-2 style.

NeMo 2's real stack runs on CPU too (tests/nemo/test_nemo_real.py, the NeMo tier: nemo_toolkit 2.7.3,
megatron-core 0.15.3, Lightning 2.4.0, ~20 s of setup per rank before a step). This replica orders
the operations that decide whether MXFP8 weights are right the way NeMo does (references are to
``nemo/lightning`` of nemo_toolkit 2.7.3):

* ``MegatronStrategy.training_step``: ``zero_grad_buffer()`` on every chunk and ``zero_grad()`` on
  every optimizer, then ``MegatronParallel.forward``, which fires ``on_megatron_microbatches_start``
  on every trainer callback that defines it (``CallbackConnector``) - in training, validation and
  test steps alike -, runs the microbatches and finalizes the grads; the Megatron optimizer steps
  through a ``torch.optim.Optimizer`` wrapper that keeps it as ``.mcore_optimizer``. Nothing
  stages the fp32 main params.
* Validation: plain forwards; the forward pre-hooks stay enabled.
* ``MegatronStrategy.save_checkpoint``: ``force_param_sync()`` (synchronous all-gather on every
  chunk, pre-hooks untouched) before the weights are read. NeMo's ``ModelCheckpoint`` saves the
  step that reaches ``max_steps`` weights-only, for which Lightning fires no ``on_save_checkpoint``.

tests/nemo/test_nemo_real.py asserts that the ``nemo_real`` order records the same hooks, NeMo events,
pre-hook toggles and forced param syncs, at the same steps, as the real stack
(:func:`make_event_recorder`, :func:`record_param_syncs`). The replica is kept for what the real
stack cannot do here: run in the main suite and the release matrix (core 0.14 ... 0.19; NeMo 2.7.3
runs only on core 0.15), in seconds rather than minutes; loop orders NeMo does not have
(:class:`LoopOrder`: a Bridge-style user loop, staging with pre-hooks on, the sanity check with a
save) on the toy model whose numels exercise defect A.

Each rank runs one process-local Trainer (``devices=1``); the collectives are megatron-core's own,
over the process group the launcher set up.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.megatron_lm_loop import dp_mean
from mbridge_mxfp8_plugin.testing.toy import Job, ToyConfig, make_batches

from .bridge_steps import _handle_mxfp8_param_buffer_copy

__all__ = [
    "ORDERS",
    "RECORDED_HOOKS",
    "LoopOrder",
    "LightningRun",
    "make_event_recorder",
    "record_param_syncs",
    "run_lightning_orders",
]

#: The trainer hooks the plugin acts on, recorded (with the global step) by :func:`make_event_recorder`.
RECORDED_HOOKS = (
    "on_fit_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_save_checkpoint",
    "on_train_end",
)


def make_event_recorder(events: list[str]) -> Any:
    """A Lightning callback appending ``"<hook>@<global_step>"`` to ``events`` for every recorded hook.

    Also NeMo's ``on_megatron_microbatches_start`` (``"microbatches[train|eval]@step"``), which the
    real ``MegatronParallel`` and this replica fire to every callback defining it. Used to assert
    that the replica's NeMo order is the real stack's (tests/nemo/test_nemo_real.py).
    """
    import lightning.pytorch as pl

    def hook(name: str) -> Any:
        def record(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
            events.append(f"{name}@{int(trainer.global_step)}")

        return record

    def microbatches(self: Any, step: Any = None, **kwargs: Any) -> None:
        trainer = self._trainer
        kind = "eval" if getattr(step, "forward_only", False) else "train"
        events.append(f"microbatches[{kind}]@{int(trainer.global_step) if trainer else -1}")

    def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    body: dict[str, Any] = {name: hook(name) for name in RECORDED_HOOKS}
    body.update(on_megatron_microbatches_start=microbatches, setup=setup, _trainer=None)
    return type("EventRecorder", (pl.Callback,), body)()


@contextlib.contextmanager
def record_param_syncs(events: list[str], step: Callable[[], int]) -> Iterator[None]:
    """Record every forced param all-gather (``"force_param_sync@step"``) and pre-hook toggle.

    Wraps megatron-core's ``DistributedDataParallel`` methods at class level, so the real NeMo
    strategy's ``force_param_sync()`` and this replica's are seen the same way.
    """
    from megatron.core.distributed import DistributedDataParallel as DDP

    names = ("start_param_sync", "disable_forward_pre_hook", "enable_forward_pre_hook")
    real = {n: getattr(DDP, n) for n in names}

    def start_param_sync(self: Any, *args: Any, force_sync: bool = False, **kwargs: Any) -> Any:
        if force_sync:
            events.append(f"force_param_sync@{step()}")
        return real["start_param_sync"](self, *args, force_sync=force_sync, **kwargs)

    def toggle(name: str) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(f"{name}@{step()}")
            return real[name](self, *args, **kwargs)

        return wrapped

    DDP.start_param_sync = start_param_sync  # type: ignore[method-assign]
    DDP.disable_forward_pre_hook = toggle("disable_forward_pre_hook")  # type: ignore[method-assign]
    DDP.enable_forward_pre_hook = toggle("enable_forward_pre_hook")  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(DDP, name, fn)


@dataclass(frozen=True)
class LoopOrder:
    """One way a Lightning loop orders staging, forced syncs and pre-hook toggles."""

    name: str
    #: NeMo's MegatronParallel: fire ``on_megatron_microbatches_start`` to the trainer callbacks.
    nemo_events: bool = True
    #: the loop copies main params into the shared buffer itself, like Bridge's train_step.
    stages_main_params: bool = False
    #: Bridge: the first iteration runs with the pre-hooks disabled (no sync).
    first_step_without_hooks: bool = False
    #: Bridge: ``disable_forward_pre_hook()`` before the callbacks' on_validation_start, enable after.
    toggle_hooks_around_validation: bool = False
    #: NeMo: ModelCheckpoint every N steps -> strategy.save_checkpoint -> force_param_sync().
    save_every: int | None = None
    num_sanity_val_steps: int = 0


ORDERS: dict[str, LoopOrder] = {
    # NeMo 2 default: no forced sync at all, pre-hooks on during validation.
    "nemo": LoopOrder("nemo"),
    # NeMo 2 with a checkpoint save right before each validation and the sanity check.
    "nemo_save_sanity": LoopOrder("nemo_save_sanity", save_every=3, num_sanity_val_steps=2),
    # The configuration tests/nemo/test_nemo_real.py runs on NeMo's real stack: fit with a save every 3
    # steps (the last one weights-only), then test.
    "nemo_real": LoopOrder("nemo_real", save_every=3),
    # A user loop that stages like Bridge but validates with pre-hooks on (NeMo's validation).
    "staging_prehooks": LoopOrder("staging_prehooks", nemo_events=False, stages_main_params=True),
    # Bridge's order around eval, in Lightning.
    "bridge": LoopOrder(
        "bridge",
        nemo_events=False,
        stages_main_params=True,
        first_step_without_hooks=True,
        toggle_hooks_around_validation=True,
    ),
}


@dataclass
class LightningRun:
    """What one Trainer.fit produced on one rank (losses are DP means, equal on every rank)."""

    order: str
    mode: str
    train_losses: list[float] = field(default_factory=list)
    #: (global_step, sanity_check, loss) per validation run, in order.
    val_losses: list[tuple[int, bool, float]] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)
    #: loss of ``trainer.test()`` run after fit, on the same data as validation.
    test_loss: float | None = None
    plugin_events: list[str] = field(default_factory=list)
    #: mode ``plugin_verify``: the weight check's train-start warm-up (seconds; None: none ran)
    #: and each check's (event, ok) after it
    verify_prepared_s: float | None = None
    verify_reports: list[tuple[str, bool]] = field(default_factory=list)
    #: every recorded hook and forced param sync (:func:`make_event_recorder`, :func:`record_param_syncs`).
    events: list[str] = field(default_factory=list)


class McoreOptimizerWrapper(torch.optim.Optimizer):
    """Like NeMo's ``McoreDistributedOptimizer``: a torch Optimizer face for Lightning."""

    def __init__(self, optim: Any) -> None:  # no super().__init__: it needs params
        self.defaults: dict[str, Any] = {}
        self.mcore_optimizer = optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mcore_optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.mcore_optimizer.step()
        return loss

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:
        return {}

    @state.setter
    def state(self, value: Any) -> None:
        pass

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return list(self.mcore_optimizer.param_groups)

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class ChunkWrapper(torch.nn.Module):
    """NeMo wraps each DDP chunk once more (``Float16Module.module`` is the DDP chunk)."""

    def __init__(self, ddp: Any) -> None:
        super().__init__()
        self.module = ddp

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


class MegatronParallelLike(torch.nn.ModuleList):
    """A list-like container of chunks, as NeMo's ``MegatronParallel`` is."""


class _EvalSteps:
    """The validation and test side of the toy module (and the NeMo event it fires in every step),
    mixed into the Lightning module :func:`_toy_module_class` builds."""

    def _fire_nemo(self, name: str, step: Any) -> None:
        trainer: Any = self.trainer
        for cb in trainer.callbacks:  # CallbackConnector: every callback with the method
            method = getattr(cb, name, None)
            if callable(method):
                method(step=step)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.order.nemo_events:
            self._fire_nemo("on_megatron_microbatches_start", _Step(forward_only=True))
        x, y = batch
        self._val.append(self.megatron_parallel[0](x, y).detach())

    def on_validation_epoch_end(self) -> None:
        loss = dp_mean(torch.stack(self._val).mean())
        self._val = []
        self.record.val_losses.append(
            (int(self.trainer.global_step), bool(self.trainer.sanity_checking), loss)
        )

    test_step = validation_step  # the same forward; the epoch-end hooks keep the two apart

    def on_test_epoch_end(self) -> None:
        self.record.test_loss = dp_mean(torch.stack(self._val).mean())
        self._val = []

    def on_validation_end(self) -> None:
        # Runs after every callback's on_validation_end: Bridge re-enables here.
        if self.order.toggle_hooks_around_validation and self.toggle:
            for chunk in self.job.model:
                chunk.enable_forward_pre_hook()


def _nemo_like_classes() -> tuple[type, type, type]:
    """NeMo's strategy and checkpoint callback, and Bridge's eval bracket, on Lightning's classes."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class NeMoLikeStrategy(SingleDeviceStrategy):
        """``save_checkpoint`` as NeMo's ``MegatronStrategy``: force a param sync, then read weights."""

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
        ) -> None:
            module: Any = self.lightning_module
            ddp = module.job.ddp_config
            if ddp.use_distributed_optimizer and ddp.overlap_param_gather:
                for chunk in module.job.model:
                    chunk.start_param_sync(force_sync=True)
            module.record.saves.append(int(module.trainer.global_step))
            # No file: the toy's emulated MXFP8 tensors need no round trip to test the order.

        def remove_checkpoint(self, filepath: Any) -> None:
            pass

        def model_to_device(self) -> None:
            # megatron-core allocated everything on the (shimmed) device already; Module.to()
            # under cpu_shim would also trip over its bool-as-ordinal device rewrite.
            pass

    class NeMoLikeCheckpoint(ModelCheckpoint):
        """NeMo's ``ModelCheckpoint`` saves the step that reaches ``max_steps`` weights-only (without
        ``save_optim_on_train_end``), and Lightning fires no ``on_save_checkpoint`` for such a save."""

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            weights_only = self.save_weights_only or trainer.global_step == trainer.max_steps
            trainer.save_checkpoint(filepath, weights_only)
            self._last_global_step_saved = trainer.global_step

    class HookToggle(pl.Callback):
        """Bridge's eval bracket: runs before the plugin on start (listed first)."""

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if pl_module.toggle:
                for chunk in pl_module.job.model:
                    chunk.disable_forward_pre_hook()  # forced all-gather

    return NeMoLikeStrategy, NeMoLikeCheckpoint, HookToggle


def _toy_module_class() -> type:
    """The toy job as a ``LightningModule`` stepping megatron-core's DDP chunks and optimizer."""
    import lightning.pytorch as pl

    class ToyLightningModule(_EvalSteps, pl.LightningModule):
        def __init__(self, job: Job, order: LoopOrder, record: LightningRun, events: list[str]) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.job = job
            self.order = order
            self.record = record
            self.events = events
            self.megatron_parallel = MegatronParallelLike([ChunkWrapper(c) for c in job.model])
            self.toggle = bool(
                job.ddp_config.use_distributed_optimizer and job.ddp_config.overlap_param_gather
            )
            self._val: list[torch.Tensor] = []
            self._first = True

        def configure_optimizers(self) -> Any:
            return McoreOptimizerWrapper(self.job.optimizer)

        def on_train_start(self) -> None:
            if self.order.first_step_without_hooks and self.toggle:
                for chunk in self.job.model:
                    chunk.disable_forward_pre_hook(param_sync=False)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            job = self.job
            opt: Any = self.optimizers()
            for chunk in job.model:
                chunk.zero_grad_buffer()
            opt.zero_grad()
            if self.order.stages_main_params:
                _handle_mxfp8_param_buffer_copy(
                    job.optimizer,
                    job.model,
                    job.optimizer_config.reuse_grad_buf_for_mxfp8_param_ag,
                    job.ddp_config.overlap_param_gather,
                )
            if self.order.nemo_events:
                self._fire_nemo("on_megatron_microbatches_start", _Step(forward_only=False))
            x, y = batch
            loss = self.megatron_parallel[0](x, y)
            loss.backward()
            for chunk in job.model:
                chunk.finish_grad_sync()
            opt.step()
            self.record.train_losses.append(dp_mean(loss))
            if self._first and self.order.first_step_without_hooks and self.toggle:
                for chunk in job.model:
                    chunk.enable_forward_pre_hook()
            self._first = False

    return ToyLightningModule


def _build_classes() -> dict[str, Any]:
    """Lightning-dependent classes, built on first use so importing this module needs no Lightning."""
    strategy, checkpoint, hook_toggle = _nemo_like_classes()
    return {
        "ToyLightningModule": _toy_module_class(),
        "NeMoLikeStrategy": strategy,
        "HookToggle": hook_toggle,
        "NeMoLikeCheckpoint": checkpoint,
    }


@dataclass(frozen=True)
class _Step:
    """The part of NeMo's ``MegatronStep`` the callbacks read."""

    forward_only: bool


class _Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i]


def _loader(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    return torch.utils.data.DataLoader(_Batches(batches), batch_size=None, shuffle=False)


def _fit_once(
    order: LoopOrder, mode: str, toy: ToyConfig, train_steps: int, val_every: int, workdir: str
) -> LightningRun:
    from mbridge_mxfp8_plugin.testing.toy import build_job

    classes = _build_classes()
    record = LightningRun(order=order.name, mode=mode)
    trainers: list[Any] = []
    with record_param_syncs(record.events, lambda: int(trainers[0].global_step) if trainers else 0):
        # Built inside the recording: NeMo builds the DDP (which enables its pre-hooks) inside
        # the trainer's setup, and the real stack's record starts with that.
        job = build_job(replace(toy, reference=(mode == "reference")))
        _fit_and_test(order, mode, toy, train_steps, val_every, workdir, classes, job, record, trainers)
    return record


def _fit_and_test(
    order: LoopOrder,
    mode: str,
    toy: ToyConfig,
    train_steps: int,
    val_every: int,
    workdir: str,
    classes: dict[str, Any],
    job: Job,
    record: LightningRun,
    trainers: list[Any],
) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mbridge_mxfp8_plugin.adapters.lightning import MXFP8ParamSyncLightningCallback

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    module = classes["ToyLightningModule"](job, order, record, [])
    train = [make_batches(toy, 1, rank=rank, world=world, salt=i)[0] for i in range(train_steps)]
    val = make_batches(toy, 2, rank=rank, world=world, salt=99991)
    plugin = None
    if mode in ("plugin", "plugin_verify"):
        plugin = MXFP8ParamSyncLightningCallback(verify_weights=(mode == "plugin_verify"), verify_sample=1.0)
        if mode == "plugin_verify":
            _record_checks(plugin, record)
    callbacks: list[Any] = [make_event_recorder(record.events)]
    if order.toggle_hooks_around_validation:
        callbacks.append(classes["HookToggle"]())
    if plugin is not None:
        callbacks.append(plugin)
    if order.save_every:
        checkpoint = classes["NeMoLikeCheckpoint"] if order.nemo_events else ModelCheckpoint
        dirpath = os.path.join(workdir, f"{order.name}-{mode}")
        callbacks.append(checkpoint(dirpath=dirpath, every_n_train_steps=order.save_every))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=classes["NeMoLikeStrategy"](device=torch.device("cpu")),
        max_epochs=1,
        max_steps=train_steps,
        val_check_interval=val_every,
        limit_val_batches=len(val),
        num_sanity_val_steps=order.num_sanity_val_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(order.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=workdir,
    )
    trainers.append(trainer)
    trainer.fit(module, _loader(train), _loader(val))
    trainer.test(module, _loader(val), verbose=False)
    if plugin is not None:
        record.plugin_events = [f"{e}:{asdict(s)['note'] or 'ok'}" for e, s in plugin.history]
        record.verify_prepared_s = plugin.session.prepared_s


def _record_checks(plugin: Any, record: LightningRun) -> None:
    """Every report the callback's checks make, in order (the session keeps only the last)."""
    verify = plugin.session.verify

    def recorded(event: str, *args: Any, **kwargs: Any) -> Any:
        report = verify(event, *args, **kwargs)
        if report is not None:
            record.verify_reports.append((event, bool(report.ok)))
        return report

    plugin.session.verify = recorded


def _rank_body(
    orders: list[LoopOrder], modes: list[str], toy: ToyConfig, train_steps: int, val_every: int
) -> list[Any]:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    out = []
    with tempfile.TemporaryDirectory() as workdir, cpu_shim(), emulated_mxfp8():
        for order in orders:
            for mode in modes:
                out.append(_fit_once(order, mode, toy, train_steps, val_every, workdir))
    return out


def run_lightning_orders(
    orders: list[str] | None = None,
    modes: tuple[str, ...] = ("reference", "mxfp8", "plugin"),
    toy: ToyConfig | None = None,
    *,
    train_steps: int = 9,
    val_every: int = 3,
    world_size: int = 2,
) -> dict[tuple[str, str], list[LightningRun]]:
    """Fit every (order, mode) on ``world_size`` fresh ranks, in one spawn; per-rank records."""
    from mbridge_mxfp8_plugin.testing.launcher import launch

    chosen = [ORDERS[o] for o in (orders or list(ORDERS))]
    per_rank = launch(_rank_body, world_size, chosen, list(modes), toy or ToyConfig(), train_steps, val_every)
    result: dict[tuple[str, str], list[LightningRun]] = {}
    for records in per_rank:
        for rec in records:
            result.setdefault((rec.order, rec.mode), []).append(rec)
    return result


def iter_runs(result: dict[tuple[str, str], list[LightningRun]]) -> Iterator[LightningRun]:
    for runs in result.values():
        yield from runs
