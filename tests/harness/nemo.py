"""NeMo 2's real Lightning stack on 2 CPU gloo ranks: the test-only harness of tests/nemo/test_nemo_real.py.

Everything that trains is NeMo's and megatron-core's own code, nothing is stubbed: ``nl.Trainer``
with ``nl.MegatronStrategy``, ``llm.GPTModel`` (a tiny ``llm.GPTConfig``; without Transformer Engine
NeMo picks megatron-core's local layer spec), ``llm.MockDataModule``, ``llm.train``, NeMo's own
``ModelCheckpoint`` writing torch_dist checkpoints. What it takes to run that on a CPU host, each a
runtime patch (reversible, active only inside :func:`nemo_on_cpu`):

* the package's :func:`~mbridge_mxfp8_plugin.testing.cpu_shim.cpu_shim` (device, streams, type names);
* the CUDA RNG state -> a private CPU generator, as for Bridge (``harness.bridge_cpu.cpu_cuda_rng``;
  megatron-core's RNG tracker seeds and forks it; with dropout off nothing draws from it, so no value
  depends on which generator it is);
* ``torch.tensor(..., pin_memory=True)`` without the pin: NeMo logs every scalar that way, and pinning
  needs CUDA;
* ``np.product = np.prod``: megatron-core 0.15's checkpoint code calls the alias numpy 2 removed;
* NeMo's checkpoint loader ``nemo.lightning.io.pl._fix_tensors_device`` -> identity: it asserts CUDA
  is initialised, then moves tensors between CUDA devices; on CPU there is nothing to move;
* a ``MockDataModule`` subclass: NeMo 2.7.3's ``setup`` passes ``create_attention_mask`` positionally
  into ``_MockGPTDataset``'s ``seed``, so no mask is built and the no-TE attention asserts on it; and
  the mock keeps no data position in a checkpoint (``PreTrainingDataModule`` does), so a resumed fit
  would re-read the first batches;
* megatron-core's ``dequantize_fp8_tensor`` (checkpoint loads run it on every MXFP8 param) picks TE's
  API by asking ``is_te_min_version("2.0")``, which raises without TE; the emulated param has TE 2's
  ``dequantize()``, so the patched function calls that (in ``fp8_utils`` and in
  ``distrib_optimizer``, which imported it by name).

* megatron-core's torch-``Adam`` fallback (no Apex, no TE) in distributed-optimizer checkpoints:
  the harness's ``harness.bridge_cpu.torch_adam_checkpoints`` (fresh-state template, per-param
  ``step`` on load), as for Bridge.

And one configuration choice: the optimizer state is saved ``ckpt_optim_fully_reshardable=True``.
NeMo's default ``dp_reshardable`` layout asserts that every per-param optimizer state has the
param's shape (core 0.15.3 ``distrib_optimizer.py:1646``), and the torch Adam's ``step`` is a
scalar; the fully reshardable layout reads ``step`` from the param groups, as with TE's Adam.

MXFP8 without Transformer Engine: after NeMo's ``configure_model`` the linear weights of every
transformer layer become the package's emulated MXFP8 params (megatron-core recognises them as it
recognises TE's); the reference run keeps them bf16 and applies the same MXFP8 rounding in forward.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.megatron_lm_loop import dp_mean

VOCAB = 128  # NullTokenizer(127): 127 tokens + EOD; an untrained model's loss is ln 128
SEQ = 32
MXFP8_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


# ---------------------------------------------------------------- CPU patches
def _dequantize_te2(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize()


@contextlib.contextmanager
def nemo_on_cpu() -> Iterator[None]:
    """The runtime patches NeMo 2.7.3 + megatron-core 0.15.3 need on a host without CUDA."""
    import numpy as np
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer
    from nemo.lightning.io import pl as nemo_ckpt_io

    from harness.bridge_cpu import cpu_cuda_rng, patched, torch_adam_checkpoints
    from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim

    real_tensor = torch.tensor

    def tensor_unpinned(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return real_tensor(*args, **kwargs)

    targets: list[tuple[Any, str, Any]] = [
        (torch, "tensor", tensor_unpinned),
        (nemo_ckpt_io, "_fix_tensors_device", lambda ckpt: ckpt),
        (fp8_utils, "dequantize_fp8_tensor", _dequantize_te2),
        (distrib_optimizer, "dequantize_fp8_tensor", _dequantize_te2),
    ]
    if not hasattr(np, "product"):
        targets.append((np, "product", np.prod))
    with cpu_shim(), cpu_cuda_rng(), torch_adam_checkpoints(), patched(targets):
        yield


# ---------------------------------------------------------------- model and data
def _te_style_init_val() -> type:
    """The package's emulated MXFP8 tensor with TE's lifetime of the init-value accessors.

    TE attaches ``get_high_precision_init_val`` / ``clear_high_precision_init_val`` to a param and
    deletes both on clear; megatron-core probes them with ``hasattr`` and otherwise builds the fp32
    main params from the quantized values. NeMo builds a second distributed optimizer when
    ``trainer.validate`` ran before fit, which takes that second path.
    """
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    class TEStyleMXFP8Tensor(EmulatedMXFP8Tensor):
        def __getattribute__(self, name: str) -> Any:
            if name in ("get_high_precision_init_val", "clear_high_precision_init_val") and (
                "_high_precision_init_val" not in object.__getattribute__(self, "__dict__")
            ):
                raise AttributeError(name)
            return super().__getattribute__(name)

    return TEStyleMXFP8Tensor


def _to_mxfp8(module: torch.nn.Module) -> None:
    """Swap each transformer linear's weight for an emulated MXFP8 param (same megatron attributes)."""
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_quantize

    cls = _te_style_init_val()
    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] in MXFP8_LINEARS:
            old = sub.weight
            init = old.detach().to(torch.bfloat16)
            new = torch.nn.Parameter(mxfp8_quantize(init).to(torch.bfloat16).as_subclass(cls))
            new.__dict__["_high_precision_init_val"] = init.clone()  # as make_mxfp8_param keeps it
            for key, value in old.__dict__.items():  # tensor_model_parallel, partition_dim, ...
                new.__dict__.setdefault(key, value)
            sub.weight = new


def _round_in_forward(module: torch.nn.Module) -> None:
    """Reference: bf16 weights, the MXFP8 rounding applied on the fly (straight-through)."""
    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import mxfp8_quantize

    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] not in MXFP8_LINEARS:
            continue
        forward = sub.forward

        def rounded(*args: Any, _sub: Any = sub, _fwd: Any = forward, **kwargs: Any) -> Any:
            w = _sub._parameters["weight"]
            q = w + (mxfp8_quantize(w).to(w.dtype) - w).detach()
            _sub._parameters["weight"] = q  # read by the layer as self.weight
            try:
                return _fwd(*args, **kwargs)
            finally:
                _sub._parameters["weight"] = w

        sub.forward = rounded


def build(mode: str) -> tuple[Any, Any, Any]:
    """(model, data, optimizer module) for mode ``reference`` / ``mxfp8`` / ``plugin``."""
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

    from harness.bridge_cpu import NO_CPU_FUSIONS, reuse_mode_knobs

    mx = mode != "reference"

    class TinyGPT(llm.GPTModel):
        def configure_model(self, *args: Any, **kwargs: Any) -> None:
            fresh = not hasattr(self, "module")
            super().configure_model(*args, **kwargs)
            if fresh:
                (_to_mxfp8 if mx else _round_in_forward)(self.module)

        def test_step(self, batch: Any, batch_idx: int | None = None) -> Any:
            # GPTModel defines no test_step, so Trainer.test refuses to run; the validation forward.
            return self.validation_step(batch, batch_idx)

        @property
        def test_loss_reduction(self) -> Any:
            return self.validation_loss_reduction

    class MockData(llm.MockDataModule):
        """NeMo's mock data with two gaps closed that its real ``PreTrainingDataModule`` does not have.

        ``setup`` passes ``create_attention_mask`` by keyword (NeMo 2.7.3 passes it positionally into
        ``_MockGPTDataset``'s ``seed``: no mask, and the no-TE attention asserts on it). And the data
        position survives a checkpoint: the mock saves nothing and builds plain ``DataLoader``s, so a
        resumed fit would restart at sample 0 and its validation would start at the training offset.
        Here, as in ``PreTrainingDataModule``, the consumed-sample count is the datamodule's checkpoint
        state and each loader carries its mode, which NeMo's sampler reads (only ``train`` resumes).
        """

        def setup(self, stage: str = "") -> None:
            from nemo.collections.llm.gpt.data.mock import _MockGPTDataset

            make = _MockGPTDataset
            mask = self.create_attention_mask
            self._train_ds = make(
                self.tokenizer, "train", self.num_train_samples, self.seq_length, create_attention_mask=mask
            )
            self._validation_ds = make(
                self.tokenizer, "valid", self.num_val_samples, self.seq_length, create_attention_mask=mask
            )
            self._test_ds = make(
                self.tokenizer, "test", self.num_test_samples, self.seq_length, create_attention_mask=mask
            )

        def train_dataloader(self) -> Any:
            return self._loader(self._train_ds, "train")

        def val_dataloader(self) -> Any:
            return self._loader(self._validation_ds, "validation")

        def test_dataloader(self) -> Any:
            return self._loader(self._test_ds, "test")

        def _loader(self, dataset: Any, mode: str) -> Any:
            from nemo.lightning.data import WrappedDataLoader

            # consumed samples are counted from the step this loader starts at
            self.data_sampler.init_global_step = self.trainer.global_step
            return WrappedDataLoader(
                mode=mode, dataset=dataset, num_workers=0, pin_memory=False, collate_fn=dataset.collate_fn
            )

        def state_dict(self) -> dict[str, Any]:
            sampler = self.data_sampler
            done = self.trainer.global_step - sampler.init_global_step
            return {"consumed_samples": sampler.compute_consumed_samples(done)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            sampler = self.data_sampler
            sampler.init_consumed_samples = sampler.prev_consumed_samples = state_dict["consumed_samples"]
            sampler.if_first_step = 1

    tokenizer = NullTokenizer(VOCAB - 1)
    # Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
    config = llm.GPTConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        seq_length=SEQ,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=1,
        share_embeddings_and_output_weights=False,
        init_method_std=0.05,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
        **NO_CPU_FUSIONS,
    )
    model = TinyGPT(config, tokenizer=tokenizer)
    data = MockData(
        seq_length=SEQ,
        tokenizer=tokenizer,
        micro_batch_size=4,
        global_batch_size=8,
        num_train_samples=10_000,
        num_val_samples=16,
        num_test_samples=16,
        num_workers=0,
        pin_memory=False,
        create_attention_mask=True,
    )
    optimizer_config = OptimizerConfig(**reuse_mode_knobs(mx)[1], lr=3e-3, clip_grad=0.0)
    optim = nl.MegatronOptimizerModule(config=optimizer_config)
    return model, data, optim


def ddp_config(mode: str) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    from harness.bridge_cpu import reuse_mode_knobs

    return DistributedDataParallelConfig(**reuse_mode_knobs(mode != "reference")[0])


def precision_plugin(mode: str) -> Any:
    """NeMo's precision plugin writes its dtype fields over the model, DDP and optimizer configs
    (``update_config_with_dtype_overrides``), so the MXFP8 knobs must be set here as well."""
    from nemo import lightning as nl

    mx = mode != "reference"
    plugin = nl.MegatronMixedPrecision(
        precision="bf16-mixed",
        params_dtype=torch.bfloat16,
        grad_reduce_in_fp32=True,
        fp8_recipe="mxfp8" if mx else "delayed",
        fp8_param_gather=mx,
        reuse_grad_buf_for_mxfp8_param_ag=mx,
    )
    # fp8_param_gather also sets the model config's fp8_param (TE creates quantized params under
    # it), which megatron-core's config check refuses without an fp8 mode, and an fp8 mode needs
    # TE's layers. The emulation creates the MXFP8 params itself (TinyGPT.configure_model).
    plugin.dtype_config.fp8_param = False
    return plugin


# ---------------------------------------------------------------- one run on one rank
def run(
    mode: str,
    workdir: str,
    *,
    steps: int = 6,
    val_every: int = 3,
    ckpt_every: int | None = 3,
    resume_from: str | None = None,
    validate_first: bool = False,
    extra_callbacks: tuple[Any, ...] = (),
    read_back: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``trainer.validate``, ``llm.train``, ``trainer.test``; losses (DP means) and the recorded events.

    ``read_back``: checkpoint directories (of an earlier run) to read afterwards with the process
    group NeMo leaves, under ``"checkpoints"`` (:func:`read_checkpoints`); saves a launch."""
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning.pytorch", "nemo_logger", "NeMo", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import emulated_mxfp8

    with nemo_on_cpu(), emulated_mxfp8():
        out = _run(mode, workdir, steps, val_every, ckpt_every, resume_from, validate_first, extra_callbacks)
        if read_back:
            out["checkpoints"] = read_checkpoints(list(read_back))
        return out


def _run(
    mode: str,
    workdir: str,
    steps: int,
    val_every: int,
    ckpt_every: int | None,
    resume_from: str | None,
    validate_first: bool,
    extra_callbacks: tuple[Any, ...],
) -> dict[str, Any]:
    from nemo import lightning as nl
    from nemo.collections import llm

    from mbridge_mxfp8_plugin.adapters.lightning import MXFP8ParamSyncLightningCallback

    from .lightning_loop import make_event_recorder, record_param_syncs

    model, data, optim = build(mode)
    events: list[str] = []
    recorder = _LossRecorder()
    callbacks: list[Any] = [recorder, make_event_recorder(events), *extra_callbacks]
    if mode == "plugin":
        callbacks.append(MXFP8ParamSyncLightningCallback())
    # Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
    strategy = nl.MegatronStrategy(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ddp=ddp_config(mode),
        ckpt_save_optimizer=True,
        ckpt_load_optimizer=True,
        ckpt_optim_fully_reshardable=True,
        ckpt_async_save=False,
        ckpt_parallel_save=False,
        ckpt_parallel_load=False,
    )
    if ckpt_every:
        # In the trainer's callbacks, not NeMoLogger(ckpt=...): the logger's path probes
        # nvidia-resiliency-ext's local-checkpoint class, which is not installed.
        callbacks.append(
            nl.ModelCheckpoint(
                dirpath=os.path.join(workdir, mode, "checkpoints"),
                every_n_train_steps=ckpt_every,
                save_top_k=-1,
                save_last=False,
                monitor="step",
                mode="max",
                always_save_context=False,
                save_context_on_train_end=False,
                save_on_train_epoch_end=False,
                filename="{step}",
            )
        )
    trainer = nl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        plugins=precision_plugin(mode),
        max_steps=steps,
        val_check_interval=val_every,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=bool(ckpt_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    log = nl.NeMoLogger(log_dir=os.path.join(workdir, "log"), name=mode, use_datetime_version=False)
    resume = (
        nl.AutoResume(restore_config=None, resume_from_path=resume_from, resume_if_exists=False)
        if resume_from
        else None
    )
    with record_param_syncs(events, lambda: int(trainer.global_step)):
        if validate_first:
            trainer.validate(model, datamodule=data, verbose=False)
        llm.train(model, data, trainer, log=log, resume=resume, optim=optim, tokenizer="data")
        # A test after fit on the same trainer: NeMo's strategy would build a second optimizer around
        # the already-wrapped chunks (and fail); NeMo's own PEFT callback switches it off the same way.
        trainer.strategy._setup_optimizers = False
        trainer.ckpt_path = None  # AutoResume set it; test the weights fit left, do not reload them
        trainer.test(model, datamodule=data, verbose=False)
    out = dict(recorder.out)
    out["events"] = events
    out["ckpt_dir"] = os.path.join(workdir, mode, "checkpoints")
    return out


def _loss_recorder_base() -> Any:
    import lightning.pytorch as pl

    return pl.Callback


class _LossRecorder(_loss_recorder_base()):  # type: ignore[misc]
    """Train losses per step, validation / test losses as NeMo logs them (DP means)."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {"train": [], "val": [], "test": None}

    @staticmethod
    def _loss(outputs: Any) -> float:
        return dp_mean(outputs["loss"] if isinstance(outputs, dict) else outputs)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.out["train"].append((int(trainer.global_step), self._loss(outputs)))

    # A validation and a test never overlap: one list of batch losses serves both.
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._losses: list[float] = []

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self._losses.append(self._loss(outputs))

    on_test_start = on_validation_start
    on_test_batch_end = on_validation_batch_end

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # (step, fitting, mean loss): validate() before fit is (0, False, ...).
        fitting = bool(trainer.state.fn == "fit")
        self.out["val"].append((int(trainer.global_step), fitting, sum(self._losses) / len(self._losses)))

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self.out["test"] = sum(self._losses) / len(self._losses)


# ---------------------------------------------------------------- ranks
def _nemo_rank(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One rank of the package launcher, handed to NeMo without a process group.

    NeMo's strategy initialises megatron-core's parallel state only when it creates the default
    process group itself, so the launcher's group is used once, to agree on a fresh rendezvous
    port (the launcher's own may still be held by its store), and then destroyed.
    """
    import socket

    port = torch.zeros(1, dtype=torch.int64)
    if torch.distributed.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = int(s.getsockname()[1])
    torch.distributed.broadcast(port, 0)
    torch.distributed.destroy_process_group()
    os.environ.update(MASTER_PORT=str(int(port.item())), NODE_RANK="0")
    return fn(*args, **kwargs)  # the launcher destroys the group NeMo leaves


def launch_nemo(fn: Any, *args: Any, world: int = 2, timeout: float = 900.0, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world`` fresh spawned ranks (``testing.launcher.launch``) that
    NeMo's strategy sets up itself; per-rank results, or the failing rank's traceback."""
    from mbridge_mxfp8_plugin.testing.launcher import launch

    return launch(_nemo_rank, world, fn, args, kwargs, timeout=timeout)


# ---------------------------------------------------------------- checkpoints
def read_checkpoints(paths: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The model tensors of each NeMo torch_dist checkpoint (``<ckpt>/weights``), read with megatron-core's
    ``dist_checkpointing`` by every rank of the current process group; fp32 copies, keyed by path."""
    from megatron.core import dist_checkpointing

    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in paths:
        weights = os.path.join(path, "weights")
        meta = dist_checkpointing.load_tensors_metadata(weights)
        meta = {k: v for k, v in meta.items() if k.startswith("module.")}  # the model, not Adam's state
        for sharded in meta.values():
            sharded.replica_id = torch.distributed.get_rank()  # every rank reads the full tensors
        loaded = dist_checkpointing.load(meta, weights)
        out[path] = {k: v.float().clone() for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    return out


def checkpoint_dirs(ckpt_dir: str) -> list[str]:
    """NeMo's checkpoint directories in save order (``step=2`` is the save after 3 steps: the
    metric is logged before the step counter moves)."""
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("step=") and not n.endswith("-unfinished")]
    return [os.path.join(ckpt_dir, n) for n in sorted(names, key=lambda n: int(n.split("=")[1]))]
