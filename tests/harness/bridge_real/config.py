"""Build the ConfigContainer of a tiny GPT job for Megatron-Bridge's own ``pretrain()``.

One builder for every Bridge release CI covers (0.3.1 ... 0.6.2): fields that moved between
releases (``cfg.validation`` from 0.4) are set where the installed release has them.

Sizes: hidden 96 and ffn 160 make every MXFP8 weight a multiple of 1024 elements (so megatron-core's
MXFP8 buffer is aligned) while the bf16 params of the other buffer (layernorms, biases of 96) are
not multiples of 64: defect A lives there on core <= 0.16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from harness.bridge_cpu import NO_CPU_FUSIONS, reuse_mode_knobs

HIDDEN, FFN, HEADS, LAYERS, SEQ, VOCAB = 96, 160, 4, 2, 32, 128


@dataclass(frozen=True)
class JobSpec:
    """What one real-pretrain run does. ``mode``: reference | mxfp8 (plugin off) | aligned (plugin
    off, offsets repaired) | plugin."""

    # Job fields, alike in shape to LoopSchedule's on purpose (duplicates lists them): data, no logic.
    mode: str
    train_iters: int = 6
    eval_interval: int = 3
    eval_iters: int = 2
    save_interval: int | None = None
    save_dir: str | None = None
    load_dir: str | None = None
    #: with load_dir: the saved iteration to resume from (default: the latest)
    ckpt_step: int | None = None
    exit_interval: int | None = None
    clip_grad: float = 1e9
    lr: float = 1e-2
    pp: int = 1
    vp: int | None = None
    micro_batch_size: int = 2
    #: global batch = micro batch x data-parallel size x this
    num_microbatches: int = 1
    #: ``CommOverlapConfig.align_param_gather``; None keeps Bridge's choice, which is True for
    #: PP > 1 with a virtual pipeline and DP > 1 (and megatron-core's False otherwise)
    align_param_gather: bool | None = None
    run_test: bool = True
    #: record callback events and forced param syncs (replica-vs-real comparison)
    record_events: bool = False
    seed: int = 1234
    #: the model's ``fp8_recipe``, as a real MXFP8 job states it ("mxfp8": Bridge >= 0.6 keys its
    #: resume path on it); None keeps the provider's default
    model_fp8_recipe: str | None = None
    #: defect F runs (tests/bridge_real/test_resume_real.py): plant elements in the E4M3-subnormal
    #: range of their row blocks (harness.bridge_real.resume), patch the plugin's re-derivation after a load
    #: out (``resume_fix=False``), and record every tensor the params and main shards hold at the end
    plant_band: bool = False
    resume_fix: bool = True
    record_final: bool = False

    @property
    def mxfp8(self) -> bool:
        return self.mode != "reference"


def _kw(cls: Any, **values: Any) -> dict[str, Any]:
    """Keep only the fields the installed release's dataclass has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def build_config(spec: JobSpec, world_size: int) -> Any:
    """Import Bridge inside ``bridge_on_cpu()`` before calling this."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training import config as bc
    from megatron.bridge.training.comm_overlap import CommOverlapConfig
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    dp = world_size // spec.pp
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    model = GPTModelProvider(
        # Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
        **_kw(
            GPTModelProvider,
            num_layers=LAYERS if spec.pp == 1 else spec.pp * (spec.vp or 1),
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=HEADS,
            seq_length=SEQ,
            vocab_size=VOCAB,
            make_vocab_size_divisible_by=VOCAB,
            transformer_layer_spec=lambda _cfg: get_gpt_layer_local_spec(),
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            autocast_dtype=torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **NO_CPU_FUSIONS,
            use_cpu_initialization=True,
            pipeline_model_parallel_size=spec.pp,
            virtual_pipeline_model_parallel_size=spec.vp,
            tensor_model_parallel_size=1,
            share_embeddings_and_output_weights=spec.pp == 1,
            **({"fp8_recipe": spec.model_fp8_recipe} if spec.model_fp8_recipe else {}),
        )
    )
    mx = spec.mxfp8
    ddp_knobs, opt_knobs = reuse_mode_knobs(mx)
    ddp = bc.DistributedDataParallelConfig(
        **_kw(bc.DistributedDataParallelConfig, **ddp_knobs, check_for_nan_in_grad=False)
    )
    opt = bc.OptimizerConfig(
        **_kw(bc.OptimizerConfig, **opt_knobs, lr=spec.lr, min_lr=spec.lr, clip_grad=spec.clip_grad)
    )
    eval_knobs = dict(eval_interval=spec.eval_interval, eval_iters=spec.eval_iters)
    has_validation = "validation" in {f.name for f in dataclasses.fields(bc.ConfigContainer)}
    train = bc.TrainingConfig(
        **_kw(
            bc.TrainingConfig,
            train_iters=spec.train_iters,
            micro_batch_size=spec.micro_batch_size,
            global_batch_size=spec.micro_batch_size * dp * spec.num_microbatches,
            exit_interval=spec.exit_interval,
            **({} if has_validation else eval_knobs),
        )
    )
    extra: dict[str, Any] = {}
    if has_validation:
        extra["validation"] = bc.ValidationConfig(**_kw(bc.ValidationConfig, **eval_knobs))
    checkpoint = bc.CheckpointConfig(
        **_kw(
            bc.CheckpointConfig,
            save=spec.save_dir,
            save_interval=spec.save_interval,
            load=spec.load_dir,
            ckpt_step=spec.ckpt_step,
            ckpt_format="torch_dist",
            async_save=False,
            fully_parallel_save=False,
            save_tokenizer_assets=False,
        )
    )
    dataset = bc.MockGPTDatasetConfig(
        seq_length=SEQ,
        **_kw(
            bc.MockGPTDatasetConfig,
            random_seed=spec.seed,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            split="1,1,1",
            dataloader_type="single",
            num_workers=0,
            data_sharding=True,
        ),
    )
    return bc.ConfigContainer(
        rng=bc.RNGConfig(seed=spec.seed),
        train=train,
        model=model,
        optimizer=opt,
        ddp=ddp,
        scheduler=bc.SchedulerConfig(
            **_kw(
                bc.SchedulerConfig,
                lr_decay_style="constant",
                lr_warmup_iters=0,
                start_weight_decay=0.0,
                end_weight_decay=0.0,
            )
        ),
        dataset=dataset,
        logger=bc.LoggerConfig(**_kw(bc.LoggerConfig, log_interval=1, tensorboard_dir=None)),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        checkpoint=checkpoint,
        dist=bc.DistributedInitConfig(**_kw(bc.DistributedInitConfig, distributed_backend=backend)),
        # Bridge copies overlap_param_gather onto the optimizer config only through this section
        comm_overlap=CommOverlapConfig(
            **_kw(
                CommOverlapConfig,
                tp_comm_overlap=False,
                overlap_grad_reduce=True,
                overlap_param_gather=True,
                align_param_gather=spec.align_param_gather,
            )
        ),
        **extra,
    )
