"""What Megatron-Bridge accepts, written down, and how a YAML value is judged against a type.

Megatron-Bridge cannot be imported without Transformer Engine, and importing torch plus
megatron-core costs seconds; a validator that needs the training stack to tell a user their YAML
has a typo is useless on a login node. The Bridge facts below were read from the released wheels
0.3.1, 0.4.2, 0.5.1 and 0.6.2 (``training/config.py``, ``mixed_precision.py``); what the
*installed* releases accept is read from their files by :mod:`.installed`.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from ..options import PLUGIN_SECTION, option_types

__all__ = [
    "CONFIG_SECTIONS",
    "MIXED_PRECISION_FIELDS",
    "MIXED_PRECISION_RECIPES",
    "MP_OWNED_KNOBS",
    "PLUGIN_SECTION",
    "HYDRA_KEYS",
    "plugin_fields",
    "describe_type",
    "closest",
    "example_value",
    "normalize_recipe_name",
    "suggest",
    "type_problem",
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
    "params_dtype": "dtype?",
    "pipeline_dtype": "dtype?",
    "autocast_dtype": "dtype?",
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

def plugin_fields() -> dict[str, Any]:
    """The ``mxfp8_plugin:`` section's schema: :class:`~..options.PluginOptions`' fields."""
    return option_types()


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
}

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


def closest(word: str, choices: Iterable[object]) -> str | None:
    """The closest valid name, for typos (``dpp`` -> ``ddp``)."""
    close = difflib.get_close_matches(word, sorted(str(c) for c in choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: Iterable[object]) -> str:
    """' (did you mean X?)' for a close match, else ''."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def example_value(annotation: Any) -> str:
    """A YAML literal of the right type, for fix snippets."""
    if annotation == "dtype?":
        return "bfloat16"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return example_value(args[0])
    return {bool: "true  # or false, unquoted", int: "1", float: "1.0", str: "name"}.get(annotation, "...")


#: Hydra's reserved keys in a ``_target_`` section: consumed by instantiate(), not fields.
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_", "_call_"})


def describe_type(annotation: Any) -> str:
    """A short human name for an annotation, for 'expected ...' messages."""
    if annotation == "dtype?":
        return "a torch dtype name such as 'bfloat16', or null"
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [describe_type(a) for a in args if a is not type(None)]
        optional = type(None) in args
        return " or ".join(names) + (" or null" if optional else "")
    if annotation is bool:
        return "a boolean (true/false)"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    name = getattr(annotation, "__name__", None) or str(annotation)
    return f"a {name}"


def type_problem(value: Any, annotation: Any) -> str | None:
    """``None`` if ``value`` fits ``annotation`` as YAML can express it, else the expectation.

    Strict where it matters: ``1`` or ``"true"`` is not a boolean (a quoted ``"false"`` is truthy
    in Python and would silently turn a knob *on*), ``true`` is not an integer.
    """
    if annotation is Any or annotation is None:
        return None
    if annotation == "dtype?":
        from .installed import dtype_name_problem

        return dtype_name_problem(value)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if any(type_problem(value, a) is None for a in args):
            return None
        return describe_type(annotation)
    if origin is typing.Literal:
        return None if value in args else "one of " + ", ".join(repr(a) for a in args)
    if annotation is type(None):
        return None if value is None else "null"
    if annotation is bool:
        return None if isinstance(value, bool) else describe_type(bool)
    if annotation is int:
        # Hydra and OmegaConf read ``4e7`` as a float; Bridge sets it as is and megatron-core only
        # compares it, so an integral float is accepted where an integer is expected.
        integral = isinstance(value, float) and value.is_integer()
        ok = (isinstance(value, int) and not isinstance(value, bool)) or integral
        return None if ok else describe_type(int)
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else describe_type(float)
    if annotation is str:
        return None if isinstance(value, str) else describe_type(str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return None if isinstance(value, (list, tuple)) else "a list"
    if origin is dict or annotation is dict:
        return None if isinstance(value, Mapping) else "a mapping"
    return None  # callables, enums, nested configs: not something a YAML knob check can judge
