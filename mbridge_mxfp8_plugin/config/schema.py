"""What Megatron-Bridge accepts, written down (the facts a check needs when its files cannot say).

Megatron-Bridge cannot be imported without Transformer Engine, and importing torch plus
megatron-core costs seconds; a validator that needs the training stack to tell a user their YAML
has a typo is useless on a login node. The Bridge facts below were read from the released wheels
0.3.1, 0.4.2, 0.5.1 and 0.6.2 (``training/config.py``, ``mixed_precision.py``); what the
*installed* releases accept is read from their files by :mod:`.installed`.
"""

from __future__ import annotations

from typing import Any

from .._yamltypes import DTYPE
from ..options import PLUGIN_SECTION

__all__ = [
    "CONFIG_SECTIONS",
    "MIXED_PRECISION_FIELDS",
    "MIXED_PRECISION_RECIPES",
    "MP_OWNED_KNOBS",
    "PLUGIN_SECTION",
    "HYDRA_KEYS",
    "normalize_recipe_name",
]

#: ``ConfigContainer`` fields, union over Bridge 0.3.1 ... 0.6.2 (``validation`` from 0.4,
#: ``env_vars`` from 0.6). A recipe section outside this set is dropped by Bridge with only a
#: log warning, which is how a misspelt ``dpp:`` silently trains with the defaults.
CONFIG_SECTIONS: frozenset[str] = frozenset(
    {
        "env_vars",
        "rng",
        "rerun_state_machine",
        "train",
        "model",
        "optimizer",
        "optimizer_config_override_provider",
        "ddp",
        "validation",
        "scheduler",
        "dataset",
        "logger",
        "tokenizer",
        "checkpoint",
        "dist",
        "ft",
        "straggler",
        "nvrx_straggler",
        "profiling",
        "peft",
        "comm_overlap",
        "mixed_precision",
        "tensor_inspect",
        "inprocess_restart",
    }
)

#: ``MixedPrecisionConfig`` fields and their types (``fp4_param*`` from Bridge 0.4).
MIXED_PRECISION_FIELDS: dict[str, Any] = {
    "fp32": bool,
    "fp16": bool,
    "bf16": bool,
    "params_dtype": DTYPE,
    "pipeline_dtype": DTYPE,
    "autocast_dtype": DTYPE,
    "autocast_enabled": bool,
    "grad_reduce_in_fp32": bool,
    "fp8": str | None,
    "fp8_recipe": str,
    "first_last_layers_bf16": bool,
    "fp8_margin": int,
    "fp8_amax_history_len": int,
    "fp8_amax_compute_algo": str,
    "fp8_wgrad": bool,
    "fp8_dot_product_attention": bool,
    "fp8_multi_head_attention": bool,
    "fp8_param": bool | None,
    "fp8_param_gather": bool,
    "fp4": str | None,
    "fp4_recipe": str,
    "fp4_param": bool | None,
    "fp4_param_gather": bool,
    "loss_scale": float | None,
    "initial_loss_scale": float | None,
    "min_loss_scale": float,
    "loss_scale_window": float,
    "hysteresis": int,
    "num_layers_at_start_in_bf16": int,
    "num_layers_at_end_in_bf16": int,
    "reuse_grad_buf_for_mxfp8_param_ag": bool,
}

_BF16 = {"bf16": True, "fp16": False, "grad_reduce_in_fp32": True}
_FP16 = {"bf16": False, "fp16": True, "grad_reduce_in_fp32": False}
_NO_FP8 = {
    "fp8": None,
    "fp8_recipe": "tensorwise",
    "fp8_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
}
_MX = {
    "fp8": "e4m3",
    "fp8_recipe": "mxfp8",
    "fp8_param_gather": True,
    "reuse_grad_buf_for_mxfp8_param_ag": True,
}
_DELAYED = {**_NO_FP8, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param_gather": True}
_CURRENT = {**_NO_FP8, "fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True}
_SUBCHANNEL = {**_NO_FP8, "fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param_gather": False}

#: Bridge's registered mixed-precision recipes (``@register`` in mixed_precision.py), with the
#: values of the knobs this plugin cares about. Bridge also accepts each name with '-' for '_'.
MIXED_PRECISION_RECIPES: dict[str, dict[str, Any]] = {
    "bf16_mixed": {**_BF16, **_NO_FP8},
    "fp16_mixed": {**_FP16, **_NO_FP8},
    "bf16_with_fp8_delayed_scaling_mixed": {**_BF16, **_DELAYED},
    "fp16_with_fp8_delayed_scaling_mixed": {**_FP16, **_DELAYED},
    "bf16_with_mxfp8_mixed": {**_BF16, **_MX},
    "fp16_with_mxfp8_mixed": {**_FP16, **_MX},
    "bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT},
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT},
    "nanov2_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT, "fp8_recipe": "blockwise"},
    "fp16_with_fp8_current_scaling_mixed": {**_FP16, **_CURRENT},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, **_SUBCHANNEL},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16, **_SUBCHANNEL},
    "bf16_with_nvfp4_mixed": {**_BF16, **_NO_FP8},
    "nemotron_3_super_bf16_with_nvfp4_mixed": {**_BF16, **_NO_FP8},  # Bridge >= 0.4
    "nemotron_3_ultra_bf16_with_nvfp4_mixed": {**_BF16, **_NO_FP8},  # Bridge >= 0.6
}

#: ``MixedPrecisionConfig.setup`` copies every one of its fields onto the model, optimizer and
#: DDP configs that have a field of the same name, so these knobs are *owned* by
#: ``mixed_precision`` whenever it is set: a value written under ``ddp:`` is silently replaced.
MP_OWNED_KNOBS: dict[str, tuple[str, ...]] = {
    "fp8_param_gather": ("ddp",),
    "reuse_grad_buf_for_mxfp8_param_ag": ("ddp", "optimizer"),
    "grad_reduce_in_fp32": ("ddp",),
    "fp8_recipe": ("optimizer", "model"),
    "fp8": ("model",),
    "fp8_param": ("model",),
}

#: Extra ``ddp`` fields Bridge's subclass adds on top of megatron-core's (Bridge >= 0.5).
BRIDGE_DDP_EXTRA: dict[str, Any] = {"param_name_patterns_for_fp32_local_accumulation": list | None}

#: Model knobs the validator reads, with their types (the model section itself is not
#: key-checked: providers carry hundreds of fields that differ per model family).
MODEL_KNOBS: dict[str, Any] = {
    "tensor_model_parallel_size": int,
    "pipeline_model_parallel_size": int,
    "context_parallel_size": int,
    "expert_model_parallel_size": int,
    "expert_tensor_parallel_size": int | None,
    "fp8": str | None,
    "fp8_recipe": str | None,
    "fp8_param": bool | None,
    "num_moe_experts": int | None,
    # a string, a comma-separated string or a list; enum members on a live config
    "cuda_graph_impl": str,
    "cuda_graph_scope": Any,
}

#: Model knobs read from live config objects only: fields some releases lack (megatron-core
#: 0.19's ``cuda_graph_modules``), so a recipe key is judged by the installed release's fields.
MODEL_OBJECT_KNOBS: dict[str, Any] = {**MODEL_KNOBS, "cuda_graph_modules": Any}

DIST_KNOBS: dict[str, Any] = {"use_megatron_fsdp": bool}
COMM_OVERLAP_KNOBS: dict[str, Any] = {
    "overlap_grad_reduce": bool | None,
    "overlap_param_gather": bool | None,
    "overlap_param_gather_with_optimizer_step": bool | None,
    "align_param_gather": bool | None,
    "bucket_size": int | None,
}


def normalize_recipe_name(name: str) -> str:
    """Bridge's ``get_mixed_precision_config`` maps '-' to '_' before the lookup."""
    return name.replace("-", "_")


#: Hydra's reserved keys in a ``_target_`` section: consumed by instantiate(), not fields.
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_", "_call_"})
