"""Defect F through the Lightning callback: ``Trainer.fit(ckpt_path=...)`` resumes a real Lightning
checkpoint (tests/harness/lightning_loop.py's module and loop orders, the toy job on real
megatron-core).

The checkpoint is Lightning's own dict (loops, global step, callbacks) written by
``trainer.save_checkpoint`` at the end of epoch 0 (3 steps), with what a megatron checkpoint holds
in place of the module's tensors: every model weight as bf16 (an MXFP8 param dequantized) and
the distributed optimizer's state (harness.resume_loop). Lightning's restore then loads the
weights through ``LightningModule.load_state_dict``, i.e. each param's own ``copy_`` (an MXFP8
param quantizes again, as TE's does), and the module's ``on_load_checkpoint`` loads the optimizer
state. One epoch is 3 batches, so the resumed run sees the batches the uninterrupted one does.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch

from harness.resume_loop import final_state, load_optimizer_state, saved_values, take_checkpoint, toy_config

EPOCH = 3
STEPS = 6


def _classes() -> dict[str, Any]:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from harness.lightning_loop import _build_classes

    base = _build_classes()

    class ResumableStrategy(SingleDeviceStrategy):
        """Writes and reads Lightning's checkpoint dict with megatron's view of the model (bf16
        weights, the distributed optimizer's state)."""

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
        ) -> None:
            job = self.lightning_module.job
            # Keyed as load_state_dict reads them (megatron's DDP names its state without "module.")
            checkpoint["state_dict"] = {
                k: saved_values(p) for k, p in self.lightning_module.named_parameters()
            }
            checkpoint["megatron_optimizer"] = take_checkpoint(job)["optimizer"]
            os.makedirs(os.path.dirname(str(filepath)), exist_ok=True)
            torch.save(checkpoint, filepath)

        def load_checkpoint(self, checkpoint_path: Any, **kwargs: Any) -> dict[str, Any]:
            return torch.load(checkpoint_path, weights_only=False)

        def remove_checkpoint(self, filepath: Any) -> None:
            pass

        def model_to_device(self) -> None:
            pass

    class ResumableModule(base["ToyLightningModule"]):  # type: ignore[misc, valid-type]
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            load_optimizer_state(self.job, checkpoint["megatron_optimizer"])

    return {**base, "ResumableStrategy": ResumableStrategy, "ResumableModule": ResumableModule}


def _fit(
    order_name: str, kind: str, steps: int, workdir: str, ckpt: str | None, save: bool = False
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from harness.lightning_loop import ORDERS, LightningRun, _loader
    from harness.resume_loop import planted_band
    from mbridge_mxfp8_plugin.adapters.lightning import MXFP8ParamSyncLightningCallback
    from mbridge_mxfp8_plugin.testing.toy import build_job, make_batches

    classes = _classes()
    with planted_band(True):
        job = build_job(toy_config(kind, True))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    record = LightningRun(order=order_name, mode="plugin")
    module = classes["ResumableModule"](job, ORDERS[order_name], record, [])
    train = [make_batches(job.toy, 1, rank=rank, world=world, salt=i)[0] for i in range(EPOCH)]
    val = make_batches(job.toy, 2, rank=rank, world=world, salt=99991)
    plugin = MXFP8ParamSyncLightningCallback()
    callbacks: list[Any] = [plugin]
    if ORDERS[order_name].toggle_hooks_around_validation:
        callbacks.insert(0, classes["HookToggle"]())
    if save:
        callbacks.append(
            ModelCheckpoint(
                dirpath=workdir,
                every_n_epochs=1,
                save_on_train_epoch_end=True,
                save_top_k=-1,
                filename="{epoch}",
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=classes["ResumableStrategy"](device=torch.device("cpu")),
        # Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
        max_epochs=-1,
        max_steps=steps,
        limit_val_batches=len(val),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=workdir,
    )
    trainer.fit(module, _loader(train), _loader(val), ckpt_path=ckpt)
    return {
        "train": record.train_losses,
        "val": [loss for _, _, loss in record.val_losses],
        "final": final_state(job),
        "history": [(e, s.note, s.all_gathers) for e, s in plugin.history],
    }


def rank_body(cases: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    """``cases``: (loop order, param kind, fix on) -> the uninterrupted fit and the resumed one."""
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from harness.bridge_real.resume import resume_fix
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    out = []
    with tempfile.TemporaryDirectory() as workdir, cpu_shim():
        for order, kind, fix in cases:
            os.environ["MXFP8_PARAM_KIND"] = kind
            here = os.path.join(workdir, f"{order}-{kind}-{fix}")
            with emulated_mxfp8():
                full = _fit(order, kind, STEPS, here + "-full", None)
                _fit(order, kind, EPOCH, here, None, save=True)
                with resume_fix(fix):
                    resumed = _fit(order, kind, STEPS, here + "-resumed", os.path.join(here, "epoch=0.ckpt"))
            out.append({"full": full, "resumed": resumed})
    return out
