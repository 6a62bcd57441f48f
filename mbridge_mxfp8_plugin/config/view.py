"""One view over the three shapes a training config arrives in: what is written, not yet who wins.

Where a knob's value is decided, in two steps: :func:`read_config` here reads what is written
(and judges each value after the conversion the installed Bridge applies);
:class:`.effective.EffectiveConfig` then applies Bridge's precedence. Rules read knobs only
through the latter.

The rules in :mod:`.rules` must give the same verdict whether the knobs come from a recipe
YAML, a live Megatron-Bridge ``ConfigContainer`` or megatron-core's own dataclasses. What differs
is *who wins* when the same knob sits in several places, and *what is known*:

* ``recipe`` (a YAML mapping merged onto some base recipe): only the keys written are known;
  anything else comes from a base config we cannot see, so it is "unknown", never a default.
* ``bridge`` (a ``ConfigContainer``): every value is known. ``mixed_precision`` is copied onto
  the ddp / optimizer / model sections by ``runtime_config_update`` and therefore wins.
* ``mcore`` (``DistributedDataParallelConfig`` + ``OptimizerConfig`` [+ model config]): every
  value is known and nothing syncs the ddp and optimizer copies of a knob.

Reading never constructs a megatron-core config, so ``__post_init__`` asserts cannot fire here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import MXFP8UsageError
from ..options import PLUGIN_SECTION
from ..probes.bridge_facts import COMM_OVERLAP_KNOBS, DIST_KNOBS, MODEL_KNOBS, MODEL_OBJECT_KNOBS
from ..probes.fields import core_default, core_fields
from .issues import check_value, issue_type
from .sections import read_mixed_precision, read_plugin, read_recipe_sections
from .values import UNKNOWN, ConfigView, InputIssue, IssueKind, Val

__all__ = ["UNKNOWN", "ConfigView", "InputIssue", "IssueKind", "Val", "read_config"]

#: Knobs read from ddp / optimizer (all are megatron-core dataclass fields).
DDP_KNOBS = (
    "use_distributed_optimizer",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "align_param_gather",
    "fp8_param_gather",
    "reuse_grad_buf_for_mxfp8_param_ag",
    "grad_reduce_in_fp32",
    "bucket_size",
    "pad_buckets_for_high_nccl_busbw",
    "num_distributed_optimizer_instances",
    "use_megatron_fsdp",
)
OPT_KNOBS = (
    "use_distributed_optimizer",
    "overlap_param_gather",
    "overlap_param_gather_with_optimizer_step",
    "reuse_grad_buf_for_mxfp8_param_ag",
    "fp8_recipe",
    "optimizer_cpu_offload",
    "use_precision_aware_optimizer",
)

#: Fallback types of the knobs the rules read, for sections whose class is not readable here.
_KNOB_TYPES: dict[str, Mapping[str, Any]] = {
    "model": MODEL_KNOBS,
    "dist": DIST_KNOBS,
    "comm_overlap": COMM_OVERLAP_KNOBS,
}


def _read_recipe(data: Mapping[str, Any], plugin: Any, base_recipe: Any) -> ConfigView:
    view = ConfigView(kind="recipe", base_recipe=base_recipe)
    if core_fields("ddp") is None:
        view.skipped.append("ddp/optimizer keys not checked: megatron-core is not installed here")
        view.unchecked_sections += [s for s in ("ddp", "optimizer") if s in data]
    read_recipe_sections(view, data, _KNOB_TYPES)
    read_plugin(view, data.get(PLUGIN_SECTION) if plugin is None else plugin)
    dp = view.plugin.get("dp_size")
    view.data_parallel_size = dp if isinstance(dp, int) else None
    return view


def _read_object(view: ConfigView, name: str, obj: Any, knobs: Mapping[str, Any] | tuple[str, ...]) -> None:
    if obj is None:
        view.sections[name] = {}
        return
    types = core_fields(name) or {}
    kept: dict[str, Any] = {}
    for knob in knobs:
        if not hasattr(obj, knob):
            if name in ("ddp", "optimizer"):
                kept[knob] = core_default(name, knob)  # an older core without the knob: its default
            continue
        value = getattr(obj, knob)
        annotation = knobs[knob] if isinstance(knobs, Mapping) else types.get(knob)
        if annotation is None or check_value(view, name, knob, value, annotation):
            kept[knob] = value
    view.sections[name] = kept


def _plugin_from_option(view: ConfigView, plugin: Any) -> None:
    if plugin is None:
        read_plugin(view, None)
    elif isinstance(plugin, Mapping):
        read_plugin(view, plugin)
    elif dataclasses.is_dataclass(plugin):
        read_plugin(view, {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)})
    else:
        read_plugin(view, None)
        issue_type(view, PLUGIN_SECTION, plugin, "a mapping or PluginOptions")


def read_config(
    cfg: Any,
    *,
    ddp: Any = None,
    optimizer: Any = None,
    model: Any = None,
    plugin: Any = None,
    base_recipe: Any = None,
) -> ConfigView:
    """Classify ``cfg`` and read the knobs the rules need. See the module docstring for kinds.

    ``base_recipe`` (a :class:`..probes.recipe_source.RecipeSource`) says what the recipe a
    mapping is merged onto sets, as far as its source tells: the model class, MoE."""
    objects = [o for o in (ddp, optimizer, model) if o is not None]
    if cfg is not None and objects:
        raise MXFP8UsageError("pass either cfg or ddp=/optimizer=/model=, not both")
    if isinstance(cfg, Mapping):
        return _read_recipe(cfg, plugin, base_recipe)
    if (
        cfg is not None
        and not isinstance(cfg, (tuple, list))
        and hasattr(cfg, "ddp")
        and hasattr(cfg, "optimizer")
    ):
        view = ConfigView(kind="bridge")
        _read_object(view, "ddp", cfg.ddp, DDP_KNOBS)
        _read_object(view, "optimizer", cfg.optimizer, OPT_KNOBS)
        _read_object(view, "model", getattr(cfg, "model", None), MODEL_OBJECT_KNOBS)
        _read_object(view, "dist", getattr(cfg, "dist", None), DIST_KNOBS)
        if getattr(cfg, "comm_overlap", None) is not None:
            _read_object(view, "comm_overlap", cfg.comm_overlap, COMM_OVERLAP_KNOBS)
        read_mixed_precision(view, getattr(cfg, "mixed_precision", None), from_object=True)
        _plugin_from_option(view, plugin)
        dp = view.plugin.get("dp_size") or getattr(cfg, "data_parallel_size", None)
        view.data_parallel_size = dp if isinstance(dp, int) and not isinstance(dp, bool) else None
        return view
    if isinstance(cfg, (tuple, list)):
        objects = list(cfg)
    elif cfg is not None:
        objects = [cfg]
    view = ConfigView(kind="mcore")
    slots: dict[str, Any] = {}
    for obj in objects:
        slot = _classify_core_object(obj)
        if slot is None or slot in slots:
            what = "a second " + slot if slot else type(obj).__name__
            raise MXFP8UsageError(
                f"validate_config got {what}; expected a ConfigContainer, a recipe mapping, or "
                "megatron-core's "
                "DistributedDataParallelConfig + OptimizerConfig (+ TransformerConfig)"
            )
        slots[slot] = obj
    if "ddp" not in slots:
        raise MXFP8UsageError("validate_config needs megatron-core's DistributedDataParallelConfig (ddp=...)")
    _read_object(view, "ddp", slots["ddp"], DDP_KNOBS)
    _read_object(view, "optimizer", slots.get("optimizer"), OPT_KNOBS if "optimizer" in slots else ())
    _read_object(view, "model", slots.get("model"), MODEL_OBJECT_KNOBS)
    _plugin_from_option(view, plugin)
    dp = view.plugin.get("dp_size")
    view.data_parallel_size = dp if isinstance(dp, int) and not isinstance(dp, bool) else None
    return view


def _classify_core_object(obj: Any) -> str | None:
    if hasattr(obj, "overlap_grad_reduce") and hasattr(obj, "bucket_size"):
        return "ddp"
    if hasattr(obj, "clip_grad") and hasattr(obj, "lr"):
        return "optimizer"
    if hasattr(obj, "hidden_size") and hasattr(obj, "tensor_model_parallel_size"):
        return "model"
    return None
