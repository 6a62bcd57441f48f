"""One view over the three shapes a training config arrives in, with Bridge's precedence applied.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._yamltypes import closest, example_value, suggest, type_problem, yaml_literal
from ..errors import MXFP8UsageError
from ..options import PLUGIN_SECTION, PluginOptions, option_types
from .installed import (
    bridge_facts,
    container_sections,
    core_default,
    core_fields,
    dtype_name_problem,
    section_fields,
)
from .read import BaseRef
from .schema import (
    COMM_OVERLAP_KNOBS,
    CONFIG_SECTIONS,
    DIST_KNOBS,
    HYDRA_KEYS,
    MIXED_PRECISION_FIELDS,
    MIXED_PRECISION_RECIPES,
    MODEL_KNOBS,
    MODEL_OBJECT_KNOBS,
    normalize_recipe_name,
)

__all__ = ["UNKNOWN", "ConfigView", "InputIssue", "IssueKind", "Val", "read_config"]

Kind = Literal["recipe", "bridge", "mcore"]
#: What is wrong with the input itself; the rules (:mod:`.rules.inputs`) give each kind its id.
IssueKind = Literal["unknown_key", "wrong_type", "unknown_recipe"]


class _Unknown:
    """A value the config does not determine (it comes from a base recipe we cannot see)."""

    def __repr__(self) -> str:
        return "<not set>"

    def __bool__(self) -> bool:
        raise TypeError("UNKNOWN has no truth value; test `is UNKNOWN` first")


UNKNOWN: Any = _Unknown()

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


@dataclass(frozen=True)
class Val:
    """A knob's value and the dotted path it was read from (what messages point the user at)."""

    value: Any
    path: str

    @property
    def known(self) -> bool:
        return self.value is not UNKNOWN


@dataclass(frozen=True)
class InputIssue:
    """A problem with the input itself: unknown key, wrong type, unknown recipe name."""

    kind: IssueKind
    knob: str
    value: Any
    message: str
    fix: Any = None


@dataclass
class ConfigView:
    kind: Kind
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``mixed_precision`` as written: a recipe name, the field values, or absent/None.
    mp_name: str | None = None
    mp_values: dict[str, Any] | None = None
    #: ``mixed_precision`` appears in the input (even as null, which replaces the base recipe's).
    mp_stated: bool = False
    plugin: dict[str, Any] = field(default_factory=dict)
    plugin_stated: bool = False
    data_parallel_size: int | None = None
    issues: list[InputIssue] = field(default_factory=list)
    #: dotted key -> interpolation into the base recipe (its value is unknown here)
    base_refs: dict[str, str] = field(default_factory=dict)
    #: section -> the ``_target_`` Bridge instantiates it from
    targets: dict[str, str] = field(default_factory=dict)
    #: checks that could not run, and why (shown under the report)
    skipped: list[str] = field(default_factory=list)
    #: sections of the file whose keys could not be checked (MX101 must not vouch for them)
    unchecked_sections: list[str] = field(default_factory=list)

    @property
    def invalid_paths(self) -> set[str]:
        """Knobs that were written but rejected (wrong type, unknown): not "unset"."""
        return {i.knob for i in self.issues}

    @property
    def mp_present(self) -> bool:
        return self.mp_values is not None

    def raw(self, section: str, knob: str) -> Val:
        """The value written in ``section`` (UNKNOWN if not written / not readable)."""
        return Val(self.sections.get(section, {}).get(knob, UNKNOWN), f"{section}.{knob}")

    def mp(self, knob: str) -> Val:
        if self.mp_values is None:
            return Val(UNKNOWN, f"mixed_precision.{knob}")
        path = f"mixed_precision={self.mp_name}" if self.mp_name else f"mixed_precision.{knob}"
        return Val(self.mp_values.get(knob, UNKNOWN), path)


# --------------------------------------------------------------------------- readers
def _unquoted(value: Any, annotation: Any) -> str | None:
    """The value meant when a number or boolean was quoted (``'1e-4'`` -> ``0.0001``)."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    as_bool = {"true": True, "false": False}
    for kind, parse in ((bool, lambda t: as_bool[t.lower()]), (int, int), (float, float)):
        try:
            parsed = parse(text)
        except (KeyError, ValueError):
            continue
        if type_problem(parsed, annotation, dtype_name_problem) is None:
            return f"{yaml_literal(parsed)}  # unquoted" if kind is not bool else yaml_literal(parsed)
    return None


def _issue_type(view: ConfigView, path: str, value: Any, expected: str, annotation: Any = None) -> None:
    *parents, leaf = path.split(".")
    example = "{...}" if annotation is None else _unquoted(value, annotation) or example_value(annotation)
    fix = (
        "\n".join(f"{'  ' * i}{p}:" for i, p in enumerate(parents))
        + f"\n{'  ' * len(parents)}{leaf}: {example}"
    )
    view.issues.append(
        InputIssue(
            "wrong_type",
            path,
            value,
            f"{path} must be {expected}, got {value!r} ({type(value).__name__})",
            fix.lstrip("\n"),
        )
    )


def _check_value(view: ConfigView, section: str, key: str, value: Any, annotation: Any) -> bool:
    problem = type_problem(value, annotation, dtype_name_problem)
    if problem is not None:
        _issue_type(view, f"{section}.{key}", value, problem, annotation)
        return False
    return True


def _unknown_fix(section: str | None, key: str, choices: Iterable[object], value: Any) -> str:
    near = closest(key, choices)
    where = f"{section}.{key}" if section else key
    if near is None:
        return f"# remove {where}"
    if section is None:
        return f"# rename section {key}: to {near}:"
    literal = "..." if isinstance(value, (dict, list)) else yaml_literal(value)
    return f"{section}:\n  {near}: {literal}  # was {key}"


def _unknown_key_message(name: str, key: str, schema: Mapping[str, Any], owner: str | None) -> str:
    path = f"{name}.{key}"
    if name == PLUGIN_SECTION:
        return (
            f"{path} is not an option of the plugin{suggest(key, schema)}: the plugin refuses the "
            f"section (options: {', '.join(schema)})"
        )
    return f"{path} is not a field of {owner or name} in the installed release{suggest(key, schema)}"


def _read_mapping_section(
    view: ConfigView,
    name: str,
    data: Any,
    schema: Mapping[str, Any] | None,
    knobs: Mapping[str, Any] | None,
    owner: str | None = None,
) -> None:
    """Keep the section's values; check keys against ``schema`` (the fields of ``owner``) and
    types of ``schema``/``knobs``.

    A ``_target_`` section is instantiated by Bridge from the merged mapping (base recipe's
    fields plus these), so its keys are the class's fields and Hydra's own keys are not knobs.
    """
    if data is None:
        view.sections[name] = {}
        return
    if not isinstance(data, Mapping):
        _issue_type(view, name, data, "a mapping of knobs")
        return
    if "_target_" in data:
        view.targets[name] = str(data["_target_"])
    kept: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key in HYDRA_KEYS and name in view.targets:
            continue
        if schema is not None and key not in schema:
            view.issues.append(
                InputIssue(
                    "unknown_key",
                    f"{name}.{key}",
                    value,
                    _unknown_key_message(name, key, schema, owner),
                    _unknown_fix(name, key, schema, value),
                )
            )
            continue
        if isinstance(value, BaseRef):
            view.base_refs[f"{name}.{key}"] = value.expr
            continue
        annotation = schema.get(key) if schema is not None else None
        if annotation is None and knobs is not None:
            annotation = knobs.get(key)
        if annotation is not None and not _check_value(view, name, key, value, annotation):
            continue
        kept[key] = value
    view.sections[name] = kept


def _read_bridge_section(view: ConfigView, name: str, data: Any, knobs: Mapping[str, Any] | None) -> None:
    """A section whose keys are the fields of the class the installed Bridge builds it as."""
    target = str(data["_target_"]) if isinstance(data, Mapping) and "_target_" in data else None
    found = section_fields(name, target)
    schema: dict[str, Any] | None = None
    if found.fields is not None:
        schema = {**dict.fromkeys(found.fields, Any), **(knobs or {})}
    elif isinstance(data, Mapping) and data:
        view.skipped.append(f"{name}.* keys not checked: {found.why}")
        view.unchecked_sections.append(name)
    _read_mapping_section(view, name, data, schema, knobs, found.owner)


def _recipe_names(view: ConfigView) -> frozenset[str] | None:
    """The installed Bridge's mixed-precision registry; None (and a note) without Bridge."""
    facts = bridge_facts()
    if facts is None or not facts.recipe_names:
        note = (
            "mixed_precision recipe names and dtype names not checked against a registry: "
            "Megatron-Bridge is not installed here (knob values of known recipe names still judged)"
        )
        if note not in view.skipped:
            view.skipped.append(note)
        return None
    return facts.recipe_names


def _read_recipe_name(view: ConfigView, value: str, path: str) -> None:
    name = normalize_recipe_name(value)
    registry = _recipe_names(view)
    known = registry if registry is not None else frozenset(MIXED_PRECISION_RECIPES)
    if name not in known:
        facts = bridge_facts()
        where = f" (installed: {facts.version})" if facts and facts.version else ""
        view.issues.append(
            InputIssue(
                "unknown_recipe",
                path,
                value,
                f"{path}={value!r} is not a Megatron-Bridge mixed-precision recipe{where}"
                f"{suggest(name, known)}; known: {', '.join(sorted(known))}",
                {"mixed_precision": "bf16_with_mxfp8_mixed"},
            )
        )
        return
    view.mp_name = name
    if name in MIXED_PRECISION_RECIPES:
        view.mp_values = dict(MIXED_PRECISION_RECIPES[name])
    else:  # registered in this Bridge, newer than the facts written down here
        view.mp_values = {}
        view.skipped.append(f"mixed_precision={name}: a recipe this plugin has no knob table for")


def _read_mixed_precision(view: ConfigView, value: Any, *, from_object: bool) -> None:
    if value is None or isinstance(value, BaseRef):
        if isinstance(value, BaseRef):
            view.base_refs["mixed_precision"] = value.expr
        return
    if isinstance(value, str):
        _read_recipe_name(view, value, "mixed_precision")
        return
    if isinstance(value, Mapping) and "_target_" in value:
        # Bridge instantiates it: a recipe function gives that recipe, the class its fields.
        target = str(value["_target_"])
        view.targets["mixed_precision"] = target
        leaf = target.rsplit(".", 1)[-1]
        if leaf != "MixedPrecisionConfig":
            extra = sorted(str(k) for k in value if str(k) not in HYDRA_KEYS)
            if extra:
                view.issues.append(
                    InputIssue(
                        "unknown_key",
                        f"mixed_precision.{extra[0]}",
                        value[extra[0]],
                        f"mixed_precision._target_ {target} is a recipe function that takes no "
                        f"arguments; Bridge's instantiate() would pass it {', '.join(extra)} and fail",
                        f"# move {', '.join(extra)} out of mixed_precision, or use _target_: "
                        "megatron.bridge.training.mixed_precision.MixedPrecisionConfig",
                    )
                )
            _read_recipe_name(view, leaf, "mixed_precision._target_")
            return
        value = {k: v for k, v in value.items() if str(k) not in HYDRA_KEYS}
    if isinstance(value, Mapping):
        _read_mapping_section(view, "mixed_precision", value, MIXED_PRECISION_FIELDS, None)
        view.mp_values = dict(view.sections.pop("mixed_precision", {}))
        return
    if from_object and dataclasses.is_dataclass(value):
        values: dict[str, Any] = {}
        for knob, annotation in MIXED_PRECISION_FIELDS.items():
            if hasattr(value, knob):
                v = getattr(value, knob)
                if _check_value(view, "mixed_precision", knob, v, annotation):
                    values[knob] = v
        view.mp_values = values
        return
    _issue_type(view, "mixed_precision", value, "a recipe name such as 'bf16_with_mxfp8_mixed' or a mapping")


def _read_plugin(view: ConfigView, data: Any) -> None:
    view.plugin = PluginOptions().as_mapping()
    if data is None:
        return
    if not isinstance(data, Mapping):
        _issue_type(view, PLUGIN_SECTION, data, "a mapping of plugin options")
        return
    view.plugin_stated = True
    _read_mapping_section(view, PLUGIN_SECTION, data, option_types(), None)
    view.plugin.update(view.sections.pop(PLUGIN_SECTION, {}))


#: Sections read with the knobs the rules need (their types checked); every other section is
#: key-checked only. ``ddp``/``optimizer`` are megatron-core's classes, typed field by field.
_KNOB_SECTIONS: dict[str, Mapping[str, Any]] = {
    "model": MODEL_KNOBS,
    "dist": DIST_KNOBS,
    "comm_overlap": COMM_OVERLAP_KNOBS,
}


def _read_recipe(data: Mapping[str, Any], plugin: Any) -> ConfigView:
    view = ConfigView(kind="recipe")
    if core_fields("ddp") is None:
        view.skipped.append("ddp/optimizer keys not checked: megatron-core is not installed here")
        view.unchecked_sections += [s for s in ("ddp", "optimizer") if s in data]
    if bridge_facts() is None:
        _recipe_names(view)
    sections = frozenset(container_sections() or CONFIG_SECTIONS) | {PLUGIN_SECTION}
    for key in data:
        if str(key) not in sections:
            view.issues.append(
                InputIssue(
                    "unknown_key",
                    str(key),
                    "<section>",
                    f"{key!s} is not a section of Megatron-Bridge's ConfigContainer"
                    f"{suggest(str(key), sections)}; Bridge would ignore it",
                    _unknown_fix(None, str(key), sections, None),
                )
            )
    _read_mapping_section(view, "ddp", data.get("ddp"), core_fields("ddp"), dict.fromkeys(DDP_KNOBS))
    _read_mapping_section(view, "optimizer", data.get("optimizer"), core_fields("optimizer"), None)
    for name in ("model", "dist"):  # always read: the rules ask for their knobs
        _read_bridge_section(view, name, data.get(name), _KNOB_SECTIONS[name])
    special = {"ddp", "optimizer", "model", "dist", "mixed_precision", PLUGIN_SECTION}
    for name in data:
        if str(name) in sections and str(name) not in special:
            _read_bridge_section(view, str(name), data[name], _KNOB_SECTIONS.get(str(name)))
    if "mixed_precision" in data:
        view.mp_stated = True
        _read_mixed_precision(view, data["mixed_precision"], from_object=False)
    _read_plugin(view, data.get(PLUGIN_SECTION) if plugin is None else plugin)
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
        if annotation is None or _check_value(view, name, knob, value, annotation):
            kept[knob] = value
    view.sections[name] = kept


def _plugin_from_option(view: ConfigView, plugin: Any) -> None:
    if plugin is None:
        _read_plugin(view, None)
    elif isinstance(plugin, Mapping):
        _read_plugin(view, plugin)
    elif dataclasses.is_dataclass(plugin):
        _read_plugin(view, {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)})
    else:
        _read_plugin(view, None)
        _issue_type(view, PLUGIN_SECTION, plugin, "a mapping or PluginOptions")


def read_config(
    cfg: Any, *, ddp: Any = None, optimizer: Any = None, model: Any = None, plugin: Any = None
) -> ConfigView:
    """Classify ``cfg`` and read the knobs the rules need. See the module docstring for kinds."""
    objects = [o for o in (ddp, optimizer, model) if o is not None]
    if cfg is not None and objects:
        raise MXFP8UsageError("pass either cfg or ddp=/optimizer=/model=, not both")
    if isinstance(cfg, Mapping):
        return _read_recipe(cfg, plugin)
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
        _read_mixed_precision(view, getattr(cfg, "mixed_precision", None), from_object=True)
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
