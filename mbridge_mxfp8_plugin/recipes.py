"""Recipe YAMLs: Megatron-Bridge ``--config-file`` overrides plus an ``mxfp8_plugin:`` section.

A recipe is exactly what Bridge's ``process_config_with_overrides(cfg, config_filepath=...)``
merges onto a ``ConfigContainer`` (nested sections named like its fields), with one extra
top-level section for this plugin. That section is split off here, so Bridge never sees a key it
does not know (it would only log a warning and drop it - the same silence that hides typos).

Files and ``key=value`` overrides are read by :mod:`.config.read` with Bridge's own readers
(OmegaConf, Hydra's override grammar), so a value means here what it means to Bridge.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._log import log_rank_zero
from .config.installed import dtype_name_problem
from .config.read import RecipeError, read_recipe_file
from .errors import MXFP8ConfigError
from .options import PLUGIN_SECTION, PluginOptions
from .recipe_files import resolve_recipe

__all__ = [
    "PluginOptions",
    "RecipeError",
    "apply_recipe",
    "callbacks_from_recipe",
    "load_recipe",
    "read_recipe",
]


#: Bridge's scripts spell the file flag both ways (run_recipe.py: --config-file; examples: --config_file).
_FILE_FLAGS = ("--config-file", "--config_file")


def split_bridge_argv(argv: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(config_files, overrides)`` of a Bridge script's arguments (``sys.argv[1:]`` as its
    recipe scripts take them: ``--config-file FILE`` then ``key=value`` Hydra overrides).

    Any other ``--flag`` belongs to the script's own parser: refused with one line saying so,
    instead of reaching Hydra's lexer as an override.
    """
    files: list[str] = []
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in _FILE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise RecipeError(f"{arg} needs a file: {arg} FILE")
                i += 1
                value = args[i]
            files.append(value)
        elif arg.startswith("-") and not arg.startswith("~"):
            raise RecipeError(
                f"{flag!r} is not a recipe override: pass key=value overrides and --config-file FILE "
                "only (parse your script's own flags first, e.g. argparse's parse_known_args)"
            )
        else:
            overrides.append(arg)
        i += 1
    return files, overrides


def _merge_files(path: str | Path, files: list[str], overrides: list[str]) -> dict[str, Any]:
    """``path``, then each ``--config-file`` merged on top (OmegaConf.merge, as Bridge merges its
    ``--config-file`` onto the recipe), then the overrides with Hydra's parser, as Bridge applies them."""
    from omegaconf import OmegaConf

    merged: Any = OmegaConf.create(read_recipe(path))
    for extra in files:
        merged = OmegaConf.merge(merged, OmegaConf.create(read_recipe(resolve_recipe(extra))))
    if overrides:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for text in overrides:
            try:
                parsed = parser.parse_overrides([text])
                ConfigLoaderImpl._apply_overrides_to_config(overrides=parsed, cfg=merged)
            except Exception as exc:  # noqa: BLE001 - Hydra raises several types; all mean "bad override"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RecipeError(f"override {text!r}: {first}") from None
    data = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def read_recipe(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The whole recipe (plugin section included) with overrides applied; raises :class:`RecipeError`.

    ``path`` is a file or the name of a shipped recipe. ``overrides`` may be a Bridge script's
    argument list: ``--config-file FILE`` merges FILE on top (see :func:`split_bridge_argv`).
    An interpolation into the base recipe (or ``???``) cannot be resolved without it: refused
    here, where the result is meant to be applied (``check`` reports such values as "not checked" instead).
    """
    files, plain = split_bridge_argv(overrides)
    if files:
        return _merge_files(path, files, plain)
    recipe = read_recipe_file(resolve_recipe(path), plain)
    if recipe.base_refs:
        key, expr = next(iter(recipe.base_refs.items()))
        raise RecipeError(
            f"{path}: {key} is {expr}, which only the base recipe decides; apply this file with "
            "Bridge's process_config_with_overrides (which has the base), or write the value"
        )
    return recipe.data


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
#: Bridge >= 0.4's short dtype names (``str_to_dtype``) -> torch attribute names.
_DTYPE_ALIASES = {
    "fp32": "float32", "32": "float32", "32-true": "float32", "fp16": "float16", "16": "float16",
    "16-mixed": "float16", "bf16": "bfloat16", "bf16-mixed": "bfloat16", "fp8": "float8_e4m3fn",
}  # fmt: skip


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
            problem = dtype_name_problem(value)
            name = _DTYPE_ALIASES.get(value.removeprefix("torch."), value.split(".")[-1])
            dtype = getattr(torch, name, None)
            if problem or not isinstance(dtype, torch.dtype):
                raise MXFP8ConfigError(f"{path}={value!r}: expected {problem or 'a torch dtype name'}")
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
    from .config.validate import validate_config

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
    return [MXFP8ParamSyncCallback(options)]
