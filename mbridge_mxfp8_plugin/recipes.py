"""Recipe YAMLs: Megatron-Bridge ``--config-file`` overrides plus an ``mxfp8_plugin:`` section.

A recipe is exactly what Bridge's ``process_config_with_overrides(cfg, config_filepath=...)``
merges onto a ``ConfigContainer`` (nested sections named like its fields), with one extra
top-level section for this plugin. That section is split off here, so Bridge never sees a key it
does not know (it would only log a warning and drop it - the same silence that hides typos).

Dotted overrides (``ddp.bucket_size=1000``, ``+a.b=1``, ``~a.b``) follow Hydra's command-line
syntax as Bridge's example scripts pass them; values are parsed as YAML scalars.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ._log import log_rank_zero
from ._schema import PLUGIN_FIELDS, PLUGIN_SECTION
from .errors import MXFP8ConfigError

__all__ = [
    "PluginOptions",
    "RecipeError",
    "apply_recipe",
    "callbacks_from_recipe",
    "load_recipe",
    "parse_override",
    "read_recipe",
]


class RecipeError(MXFP8ConfigError):
    """The recipe could not be read at all (missing file, invalid YAML, not a mapping, bad override)."""


@dataclass(frozen=True)
class PluginOptions:
    """The ``mxfp8_plugin:`` section. Defaults are the safe choice on every release."""

    enabled: bool = True
    strict: bool = True
    repair_alignment: bool = True
    prestage: bool = True
    refresh_at_train_end: bool = True
    dp_size: int | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> PluginOptions:
        """Strict: an unknown option or a non-boolean flag is an error, not a silent default."""
        from ._schema import suggest, type_problem

        data = dict(data or {})
        problems = []
        for key, value in data.items():
            if key not in PLUGIN_FIELDS:
                problems.append(
                    f"{PLUGIN_SECTION}.{key} is not a plugin option{suggest(str(key), PLUGIN_FIELDS)}"
                )
                continue
            expected = type_problem(value, PLUGIN_FIELDS[key][0])
            if expected:
                problems.append(f"{PLUGIN_SECTION}.{key} must be {expected}, got {value!r}")
        if problems:
            raise MXFP8ConfigError("; ".join(problems))
        return cls(**data)

    def as_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- reading
def _load_yaml(path: Path) -> Any:
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read ({exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{path}: invalid YAML{where}: {problem}") from None


def parse_override(text: str) -> tuple[str, list[str], Any]:
    """``'a.b=1'`` -> ``('set', ['a', 'b'], 1)``; ``'+a.b=1'`` adds, ``'~a.b'`` deletes (Hydra syntax)."""
    op = "set"
    body = text.strip()
    if body.startswith("~"):
        op, body = "delete", body[1:]
        key, _, raw = body.partition("=")
    else:
        if body.startswith("++"):
            body = body[2:]
        elif body.startswith("+"):
            op, body = "add", body[1:]
        key, eq, raw = body.partition("=")
        if not eq:
            raise RecipeError(f"override {text!r} is not of the form dotted.key=value")
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise RecipeError(f"override {text!r} has an empty key")
    if op == "delete":
        return op, parts, None
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: value {raw!r} is not valid YAML") from None
    return op, parts, value


def apply_overrides_to_mapping(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Dotted overrides on a nested mapping; the input is not modified."""
    out = copy.deepcopy(data)
    for text in overrides:
        op, parts, value = parse_override(text)
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None and op != "delete":
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                raise RecipeError(
                    f"override {text!r}: {where} is {nxt!r}, not a section, so it has no key {parts[i + 1]!r}"
                )
            node = nxt
        if op == "delete":
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    return out


def _resolve_interpolations(data: Any, path: Path) -> Any:
    """OmegaConf ``${...}`` interpolation, as Bridge's loader resolves it; omegaconf only if used."""
    if "${" not in yaml.safe_dump(data):
        return data
    try:
        from omegaconf import OmegaConf
    except ImportError:
        raise RecipeError(
            f"{path}: uses OmegaConf interpolation (${{...}}), which needs the omegaconf package "
            "(installed with Megatron-Bridge): pip install omegaconf"
        ) from None
    return OmegaConf.to_container(OmegaConf.create(data), resolve=True)


def read_recipe(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The whole recipe (plugin section included) with overrides applied; raises :class:`RecipeError`."""
    path = Path(path)
    data = _load_yaml(path)
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty; expected a mapping of ConfigContainer sections")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise RecipeError(
            f"{path}: the recipe is {kind}; expected a mapping of ConfigContainer sections (ddp:, "
            "optimizer:, ...)"
        )
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise RecipeError(f"{path}: top-level keys must be section names, got {bad[0]!r}")
    data = apply_overrides_to_mapping(data, overrides)
    return dict(_resolve_interpolations(data, path))


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], PluginOptions]:
    """``(bridge_overrides, plugin_options)``: the plugin section split off, nothing else changed.

    ``bridge_overrides`` is what to hand Bridge's OmegaConf utilities (or :func:`apply_recipe`).
    """
    data = read_recipe(path, overrides)
    section = data.pop(PLUGIN_SECTION, None)
    if section is not None and not isinstance(section, Mapping):
        raise MXFP8ConfigError(f"{PLUGIN_SECTION} must be a mapping of plugin options, got {section!r}")
    return data, PluginOptions.from_mapping(section)


# --------------------------------------------------------------------------- applying
def _apply(obj: Any, overrides: Mapping[str, Any], prefix: str) -> list[str]:
    """Bridge's ``omegaconf_utils._apply_overrides``, except that unknown keys are returned, not skipped."""
    import torch

    unknown: list[str] = []
    for key, value in overrides.items():
        path = f"{prefix}{key}"
        if not hasattr(obj, key):
            unknown.append(path)
            continue
        current = getattr(obj, key)
        if isinstance(value, Mapping) and "_target_" in value:
            try:
                from megatron.bridge.utils.instantiate_utils import instantiate  # type: ignore[import-not-found]
            except ImportError:
                raise MXFP8ConfigError(
                    f"{path} uses _target_ instantiation, which needs an importable Megatron-Bridge"
                ) from None
            setattr(obj, key, instantiate(dict(value)))
        elif dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            unknown += _apply(current, value, f"{path}.")
        elif isinstance(current, str) and isinstance(value, Mapping):
            raise MXFP8ConfigError(
                f"{path} is {current!r} in the base config (a name, not a section), so the mapping "
                f"{dict(value)!r} cannot be merged into it; give a name instead, e.g. "
                f"{key}: bf16_with_mxfp8_mixed"
            )
        elif isinstance(current, torch.dtype) and isinstance(value, str):
            dtype = getattr(torch, value.split(".")[-1], None)
            if not isinstance(dtype, torch.dtype):
                raise MXFP8ConfigError(f"{path}={value!r} is not a torch dtype")
            setattr(obj, key, dtype)
        else:
            setattr(obj, key, value)
    return unknown


def apply_recipe(
    config_container: Any,
    path: str | Path,
    overrides: Iterable[str] = (),
    *,
    dp_size: int | None = None,
    installed: Any = None,
) -> PluginOptions:
    """Merge a recipe (and dotted overrides) into a Bridge ``ConfigContainer`` in place; validate.

    Same merge as Bridge's ``process_config_with_overrides`` (nested dataclasses updated field by
    field, dtype names converted), but validated first and last: the recipe mapping before
    anything is touched (unknown keys, types, recipe names), the merged container after (the
    MXFP8 rules). Errors raise unless the recipe says ``mxfp8_plugin.strict: false``, in which
    case they are logged. Returns the plugin options for :func:`callbacks_from_recipe`.
    """
    from .validate import validate_config

    data = read_recipe(path, overrides)
    raw_plugin = data.get(PLUGIN_SECTION)
    strict = not (isinstance(raw_plugin, Mapping) and raw_plugin.get("strict") is False)
    first = validate_config(data, dp_size=dp_size, strict=False, installed=installed)
    structural = [f for f in first.errors if f.rule.startswith("MX1")]
    if structural:
        # Unknown keys / types / names cannot be applied faithfully, strict or not.
        raise MXFP8ConfigError(first.format_errors())
    bridge_overrides, options = load_recipe(path, overrides)
    unknown = _apply(config_container, bridge_overrides, "")
    if unknown:
        raise MXFP8ConfigError(f"{path}: keys not found in the config container: {', '.join(unknown)}")
    report = validate_config(
        config_container,
        plugin=options,
        dp_size=dp_size if dp_size is not None else options.dp_size,
        strict=strict,
        installed=installed,
    )
    for finding in report.findings:
        log_rank_zero(
            logging.WARNING if finding.severity == "warning" else logging.ERROR, "%s", finding.line()
        )
    return options


def callbacks_from_recipe(source: PluginOptions | str | Path, overrides: Iterable[str] = ()) -> list[Any]:
    """The Bridge callbacks a recipe asks for: ``[MXFP8ParamSyncCallback(...)]``, or ``[]`` if disabled.

    A list because Bridge's ``CallbackManager.add`` unpacks lists only (a tuple registers nothing).
    """
    from .bridge import MXFP8ParamSyncCallback

    options = source if isinstance(source, PluginOptions) else load_recipe(source, overrides)[1]
    if not options.enabled:
        return []
    return [
        MXFP8ParamSyncCallback(
            repair_alignment=options.repair_alignment,
            prestage=options.prestage,
            refresh_at_train_end=options.refresh_at_train_end,
            strict=options.strict,
        )
    ]
