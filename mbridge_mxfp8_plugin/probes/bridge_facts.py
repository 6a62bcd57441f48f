"""Per-release Megatron-Bridge facts: written down where its files cannot say, read where they can.

Megatron-Bridge cannot be imported without Transformer Engine, and importing torch plus
megatron-core costs seconds; a validator that needs the training stack to tell a user their YAML
has a typo is useless on a login node. The written facts below were read from the released
wheels 0.3.1, 0.4.2, 0.5.1 and 0.6.2 (``training/config.py``, ``mixed_precision.py``) and are the
fallback when no Bridge is installed; :func:`bridge_facts` reads the installed release's
mixed-precision registry, its dtype names and ``MixedPrecisionConfig``'s defaults from its files.
This module and :mod:`.fields` are the only places in the plugin that know a Bridge release.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ..common.yamltypes import DTYPE
from ..options import PLUGIN_SECTION
from ._summary import MISSING, summary
from .fields import class_fields
from .loops import bridge_training_dir
from .versions import installed_version

__all__ = [
    "BRIDGE_SECTION_EXTRAS",
    "CONFIG_SECTIONS",
    "HYDRA_KEYS",
    "MIXED_PRECISION_FIELDS",
    "MIXED_PRECISION_RECIPES",
    "MP_OWNED_KNOBS",
    "PLUGIN_SECTION",
    "RENAMED_SECTIONS",
    "BridgeFacts",
    "bridge_facts",
    "dtype_name_problem",
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

#: Fields Bridge's own ``ddp`` / ``optimizer`` subclasses add to megatron-core's classes (read
#: from 0.3.1 ... main: 0.5 adds one to the DDP config), for when Bridge is not installed here.
BRIDGE_SECTION_EXTRAS: dict[str, dict[str, Any]] = {
    "ddp": {"param_name_patterns_for_fp32_local_accumulation": list},
    "optimizer": {},
}

#: Model knobs the rules read, with their types: the fallback when the installed provider
#: classes cannot be read (no Bridge here), and the knobs read from live config objects.
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


#: ``ConfigContainer``'s sections were named ``model_config``, ``train_config``, ... in
#: Megatron-Bridge's pre-release history (renamed June 2025, "Fix config container fields"),
#: and NeMo 2 users write them that way: an unknown ``X_config`` section is advised as ``X``.
RENAMED_SECTIONS: dict[str, str] = {f"{s}_config": s for s in CONFIG_SECTIONS if not s.endswith("_provider")}

#: ``torch`` attributes that are dtypes: what Bridge 0.3 accepts for a dtype field
#: (``getattr(torch, value.split(".")[-1])``), listed so that no torch import is needed.
TORCH_DTYPE_NAMES = frozenset(
    {
        "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64", "cfloat",
        "complex128", "cdouble", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long",
        "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16",
        "uint32", "uint64", "float8_e8m0fnu",
    }
)  # fmt: skip


class BridgeFacts(NamedTuple):
    """What the installed Megatron-Bridge converts, read from its files."""

    version: str | None
    #: Names registered with ``@register`` in ``training/mixed_precision.py``.
    recipe_names: frozenset[str]
    #: Strings its override merge turns into a torch dtype.
    dtype_names: frozenset[str]
    #: ``MixedPrecisionConfig`` field defaults (what a ``_target_`` instance holds when unstated).
    mp_defaults: dict[str, Any]


@functools.lru_cache(maxsize=1)
def bridge_facts() -> BridgeFacts | None:
    """The installed Bridge's registry and conversions, or None when Bridge is not installed."""
    root = bridge_training_dir()
    if root is None:
        return None
    mp_file = root / "mixed_precision.py"
    info = summary(mp_file) or {"registered": []}
    fields = class_fields(mp_file, "MixedPrecisionConfig") or {}
    mp_defaults = {k: f.default for k, f in fields.items() if f.default is not MISSING}
    dtypes = _bridge_dtype_names(root.parent / "utils" / "activation_map.py")
    return BridgeFacts(
        installed_version("megatron-bridge"), frozenset(info["registered"]), dtypes, mp_defaults
    )


def _bridge_dtype_names(activation_map: Any) -> frozenset[str]:
    """Bridge >= 0.4 converts through ``str_to_dtype`` (its ``DTYPE_MAP`` plus ``torch.`` aliases);
    earlier releases through ``getattr(torch, name.split('.')[-1])``."""
    info = summary(activation_map)
    if info is None or "DTYPE_MAP" not in info["dict_keys"]:
        return frozenset(TORCH_DTYPE_NAMES | {f"torch.{n}" for n in TORCH_DTYPE_NAMES})
    keys = set(info["dict_keys"]["DTYPE_MAP"])
    aliases = {f"torch.{k}" for k in keys if "." not in k and not k[0].isdigit() and "-" not in k}
    return frozenset(keys | aliases)


def dtype_name_problem(value: Any) -> str | None:
    """None when the installed Bridge turns ``value`` into a torch dtype (or it is null / a dtype)."""
    if value is None or type(value).__name__ == "dtype":
        return None
    facts = bridge_facts()
    if facts is None:  # no Bridge: which names it converts is unknown (the report says so)
        return None
    names = facts.dtype_names
    if isinstance(value, str) and value in names:
        return None
    shown = ", ".join(sorted(n for n in names if "." not in n)[:8])
    who = f"Megatron-Bridge {facts.version}" if facts.version else "Megatron-Bridge"
    return f"a dtype name {who} converts ({shown}, ...) or null"
