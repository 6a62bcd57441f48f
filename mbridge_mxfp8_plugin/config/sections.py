"""Reading a recipe mapping section by section: every key checked against the fields of the class
Bridge builds the section as, every value against that field's annotation in the installed release.

Which class that is decides how sure a verdict can be. A ``_target_``, the recipe named with
``check --recipe``, or a section with one concrete class (``train``, ``checkpoint``, ``ddp``...)
fix it: a key that is not a field is then an error (Bridge skips it with a log line). A union
(``model``, ``dataset``) or an abstract base leaves the class to the base recipe, which may
build a subclass from outside Bridge (a diffusion provider, the user's own): such a key is a
warning that names the classes tried.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from typing import Any

from ..common.yamltypes import suggest
from ..options import PLUGIN_SECTION, PluginOptions, option_problem, option_types
from ..probes.bridge_facts import (
    BRIDGE_SECTION_EXTRAS,
    CONFIG_SECTIONS,
    HYDRA_KEYS,
    MIXED_PRECISION_FIELDS,
    MIXED_PRECISION_RECIPES,
    bridge_facts,
    normalize_recipe_name,
)
from ..probes.fields import (
    SectionFields,
    container_sections,
    core_fields,
    section_fields,
    target_fields,
    value_domain,
)
from .issues import check_value, issue_type, unknown_key, unknown_section
from .read import BaseRef
from .values import ConfigView, InputIssue

__all__ = ["read_mixed_precision", "read_plugin", "read_recipe_sections"]

#: How to make a key of a section with an unknown class checkable.
_HOW = " (name the base recipe with check --recipe, or give the section a _target_, to check it)"


def _how(view: ConfigView, name: str) -> str:
    """How to make a key of an open section checkable (or why ``--recipe`` did not)."""
    base = view.base_recipe
    if name == "model" and base is not None and not base.provider:
        return f" (recipe {base.name}: {base.provider_why}; give model a _target_ to check it)"
    return _HOW


def _schema(view: ConfigView, name: str, data: Any) -> SectionFields:
    """The fields ``name`` is checked against, and whether its class is known (``fixed``)."""
    target = str(data["_target_"]) if isinstance(data, Mapping) and "_target_" in data else None
    if target is None and name == "model" and view.base_recipe is not None and view.base_recipe.provider:
        return target_fields(view.base_recipe.provider)
    found = section_fields(name, target)
    core = core_fields(name) if found.fields is None and name in BRIDGE_SECTION_EXTRAS else None
    if core is not None:
        # No Bridge here: megatron-core's class plus the fields Bridge's subclass adds (known).
        typed = ChainMap(BRIDGE_SECTION_EXTRAS[name], core)  # annotations still converted lazily
        return SectionFields(f"megatron-core's {name} config (+ Bridge's fields)", typed, True)  # type: ignore[arg-type]
    return found


def _fits(view: ConfigView, section: str, key: str, value: Any, annotation: Any) -> bool:
    """The annotation, then (a string knob typed ``str`` in older releases) megatron-core's enum."""
    if annotation is not None and not check_value(view, section, key, value, annotation):
        return False
    domain = value_domain(key) if isinstance(value, str) else None
    return domain is None or check_value(view, section, key, value, domain)


def read_section(view: ConfigView, name: str, data: Any, knobs: Mapping[str, Any] | None = None) -> None:
    """Keep the section's values; judge its keys and values (see the module docstring)."""
    if data is None:
        view.sections[name] = {}
        return
    if not isinstance(data, Mapping):
        issue_type(view, name, data, "a mapping of knobs")
        return
    if "_target_" in data:
        view.targets[name] = str(data["_target_"])
    found = _schema(view, name, data)
    if found.fields is None and data and not found.free:
        view.skipped.append(f"{name}.* keys not checked: {found.why}")
        view.unchecked_sections.append(name)
    schema = found.fields
    kept: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key in HYDRA_KEYS and name in view.targets:
            continue  # consumed by Hydra's instantiate(), not a field
        if schema is not None and key not in schema:
            issue = unknown_key(
                name, key, value, schema, found.owner, fixed=found.fixed, how=_how(view, name)
            )
            view.issues.append(issue)
            if issue.severity == "error":
                continue
        if isinstance(value, BaseRef):
            view.base_refs[f"{name}.{key}"] = value.expr
            continue
        annotation = (schema or {}).get(key) or (knobs or {}).get(key)
        if not _fits(view, name, key, value, annotation):
            continue
        kept[key] = value
    view.sections[name] = kept


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
    view.recipe_names_checked = True
    return facts.recipe_names


def _read_recipe_name(view: ConfigView, value: str, path: str) -> None:
    name = normalize_recipe_name(value)
    registry = _recipe_names(view)
    known = registry if registry is not None else frozenset(MIXED_PRECISION_RECIPES)
    if name not in known:
        facts = bridge_facts()
        where = f" (installed: {facts.version})" if facts and facts.version else ""
        message = (
            f"{path}={value!r} is not a Megatron-Bridge mixed-precision recipe{where}"
            f"{suggest(name, known)}; known: {', '.join(sorted(known))}"
        )
        view.issues.append(
            InputIssue("unknown_recipe", path, value, message, {"mixed_precision": "bf16_with_mxfp8_mixed"})
        )
        return
    view.mp_name = name
    if name in MIXED_PRECISION_RECIPES:
        view.mp_values = dict(MIXED_PRECISION_RECIPES[name])
    else:  # registered in this Bridge, newer than the facts written down here
        view.mp_values = {}
        view.skipped.append(f"mixed_precision={name}: a recipe this plugin has no knob table for")


def _read_mp_target(view: ConfigView, value: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A ``_target_`` mixed_precision: a recipe function gives that recipe (None returned), the
    class its fields (the mapping without Hydra's keys returned)."""
    target = str(value["_target_"])
    view.targets["mixed_precision"] = target
    leaf = target.rsplit(".", 1)[-1]
    if leaf == "MixedPrecisionConfig":
        return {k: v for k, v in value.items() if str(k) not in HYDRA_KEYS}
    extra = sorted(str(k) for k in value if str(k) not in HYDRA_KEYS)
    if extra:
        message = (
            f"mixed_precision._target_ {target} is a recipe function that takes no "
            f"arguments; Bridge's instantiate() would pass it {', '.join(extra)} and fail"
        )
        fix = (
            f"# move {', '.join(extra)} out of mixed_precision, or use _target_: "
            "megatron.bridge.training.mixed_precision.MixedPrecisionConfig"
        )
        view.issues.append(
            InputIssue("unknown_key", f"mixed_precision.{extra[0]}", value[extra[0]], message, fix)
        )
    _read_recipe_name(view, leaf, "mixed_precision._target_")
    return None


def _read_mp_mapping(view: ConfigView, value: Mapping[str, Any]) -> None:
    """Each knob judged as ``MixedPrecisionConfig``'s field, then as the model field that
    ``MixedPrecisionConfig.setup`` copies it onto (``fp8_recipe: mxfp9`` passes the first as a
    str and fails the second, megatron-core's Literal)."""
    found = section_fields("mixed_precision")
    schema = found.fields if found.fields is not None else MIXED_PRECISION_FIELDS
    model = section_fields("model").fields or {}
    kept: dict[str, Any] = {}
    for key, v in value.items():
        key = str(key)
        if key not in schema:
            view.issues.append(
                unknown_key("mixed_precision", key, v, schema, "MixedPrecisionConfig", fixed=True)
            )
            continue
        if isinstance(v, BaseRef):
            view.base_refs[f"mixed_precision.{key}"] = v.expr
            continue
        if not check_value(view, "mixed_precision", key, v, schema[key]):
            continue
        if not _fits(view, "mixed_precision", key, v, model.get(key)):
            continue
        kept[key] = v
    view.mp_values = kept


def read_mixed_precision(view: ConfigView, value: Any, *, from_object: bool) -> None:
    """``mixed_precision``: a recipe name, a mapping of fields, a ``_target_``, or (live) an object."""
    if isinstance(value, BaseRef):
        view.base_refs["mixed_precision"] = value.expr
        return
    if value is None:
        return
    if isinstance(value, str):
        _read_recipe_name(view, value, "mixed_precision")
        return
    if isinstance(value, Mapping) and "_target_" in value:
        value = _read_mp_target(view, value)
        if value is None:
            return
    if isinstance(value, Mapping):
        _read_mp_mapping(view, value)
        return
    if from_object and hasattr(value, "__dataclass_fields__"):
        values: dict[str, Any] = {}
        for knob, annotation in MIXED_PRECISION_FIELDS.items():
            if hasattr(value, knob):
                v = getattr(value, knob)
                if check_value(view, "mixed_precision", knob, v, annotation):
                    values[knob] = v
        view.mp_values = values
        return
    issue_type(view, "mixed_precision", value, "a recipe name such as 'bf16_with_mxfp8_mixed' or a mapping")


def read_plugin(view: ConfigView, data: Any) -> None:
    """The plugin's own section, judged by :func:`..options.option_problem` (the validator every
    entry point uses), so ``verify_sample: 2.0`` fails here as it fails at launch."""
    view.plugin = PluginOptions().as_mapping()
    if data is None:
        return
    if not isinstance(data, Mapping):
        issue_type(view, PLUGIN_SECTION, data, "a mapping of plugin options")
        return
    view.plugin_stated = True
    types = option_types()
    for key, value in data.items():
        key = str(key)
        if key not in types:
            view.issues.append(unknown_key(PLUGIN_SECTION, key, value, types, "the plugin", fixed=True))
            continue
        problem = option_problem(key, value)
        if problem is not None:
            fix = f"{PLUGIN_SECTION}:\n  {key}: {PluginOptions().as_mapping()[key]!r}".replace("None", "null")
            view.issues.append(InputIssue("wrong_type", f"{PLUGIN_SECTION}.{key}", value, problem, fix))
            continue
        view.plugin[key] = value


def read_recipe_sections(
    view: ConfigView, data: Mapping[str, Any], knobs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Every section of a recipe mapping; ``knobs`` gives the fallback types of the knobs the
    rules read, for sections whose class cannot be read here."""
    sections = frozenset(container_sections() or CONFIG_SECTIONS) | {PLUGIN_SECTION}
    for key in data:
        if str(key) not in sections:
            view.issues.append(unknown_section(str(key), sections))
    if bridge_facts() is None:
        _recipe_names(view)
    special = {"mixed_precision", PLUGIN_SECTION}
    # ddp, optimizer, model, dist are always read: the rules ask for their knobs.
    for name in ("ddp", "optimizer", "model", "dist"):
        read_section(view, name, data.get(name), knobs.get(name))
    for name in data:
        if str(name) in sections and str(name) not in special | {"ddp", "optimizer", "model", "dist"}:
            read_section(view, str(name), data[name], knobs.get(str(name)))
    if "mixed_precision" in data:
        view.mp_stated = True
        read_mixed_precision(view, data["mixed_precision"], from_object=False)
