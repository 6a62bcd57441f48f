"""Recipe YAMLs: Megatron-Bridge ``--config-file`` overrides plus an ``mxfp8_plugin:`` section.

A recipe is exactly what Bridge's ``process_config_with_overrides(cfg, config_filepath=...)``
merges onto a ``ConfigContainer`` (nested sections named like its fields), with one extra
top-level section for this plugin. That section is split off before anything reaches Bridge,
so Bridge never sees a key it does not know (it would only log a warning and drop it - the same
silence that hides typos).

Files and ``key=value`` overrides are read by :mod:`.config.read`, the plugin's one reader, with
Bridge's own readers (OmegaConf, Hydra's override grammar, and Bridge's ``omegaconf_utils`` when
merging onto a ``ConfigContainer``), so a value means here what it means to Bridge.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..common.log import log_rank_zero
from ..config.read import RecipeError, compose, merge_onto_container, plugin_section, split_bridge_argv
from ..config.recipe_files import resolve_recipe
from ..errors import MXFP8ConfigError
from ..options import PLUGIN_SECTION, PluginOptions

__all__ = [
    "PluginOptions",
    "RecipeError",
    "apply_recipe",
    "callbacks_from_recipe",
    "load_recipe",
    "read_recipe",
    "split_bridge_argv",
]


def _read(path: str | Path, overrides: Iterable[str]) -> tuple[list[Path], list[str], Any]:
    """``path`` and each ``--config-file`` of ``overrides`` (paths or shipped recipe names),
    the plain overrides, and the files merged with them (no base recipe)."""
    extra, plain = split_bridge_argv(overrides)
    files = [resolve_recipe(f) for f in (path, *extra)]
    return files, plain, compose(files, plain)


def read_recipe(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The whole recipe (plugin section included) with overrides applied; raises :class:`RecipeError`.

    ``path`` is a file or the name of a shipped recipe. ``overrides`` may be a Bridge script's
    argument list: ``--config-file FILE`` merges FILE on top, as Bridge merges it onto the recipe.
    An interpolation into the base recipe (or ``???``) cannot be resolved without it: refused
    here, where the result is meant to be applied (``check`` reports such values as "not checked").
    """
    recipe = _read(path, overrides)[2]
    recipe.require_resolved(
        fix="apply this file with Bridge's process_config_with_overrides or apply_recipe (which "
        "have the base), or write the value"
    )
    return recipe.data  # type: ignore[no-any-return]


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], PluginOptions]:
    """``(bridge_overrides, plugin_options)``: the plugin section split off, nothing else changed.

    ``bridge_overrides`` is what to hand Bridge's OmegaConf utilities (or :func:`apply_recipe`).
    """
    data, section = plugin_section(read_recipe(path, overrides), path)
    return data, PluginOptions.from_mapping(section)


def apply_recipe(
    config_container: Any,
    path: str | Path,
    overrides: Iterable[str] = (),
    *,
    dp_size: int | None = None,
    installed: Any = None,
) -> PluginOptions:
    """Merge a recipe (and overrides, Bridge's argv form included) into a Bridge
    ``ConfigContainer`` in place, with Bridge's own ``process_config_with_overrides`` steps; validate.

    Validated first and last: the files before anything is touched (unknown keys, types, recipe
    names: ``check``'s rules), the merged container after (the MXFP8 rules). Errors raise
    unless the recipe says ``mxfp8_plugin.strict: false``, in which case they are logged.
    Returns the plugin options for :func:`callbacks_from_recipe`.
    """
    from ..config.validate import validate_config

    files, plain, recipe = _read(path, overrides)
    recipe.require_resolved(PLUGIN_SECTION + ".", fix="write the plugin option's value")
    _, section = plugin_section(recipe.data, recipe.path)
    options = PluginOptions.from_mapping(section)
    first = validate_config(
        recipe.data, dp_size=dp_size, strict=False, installed=installed, skipped=recipe.not_checked()
    )
    structural = [f for f in first.errors if f.rule.startswith("MX1")]
    if structural:
        # Unknown keys / types / names cannot be applied faithfully, strict or not.
        raise MXFP8ConfigError(first.format_errors())
    merge_onto_container(config_container, files, plain)
    report = validate_config(
        config_container,
        plugin=options,
        dp_size=dp_size if dp_size is not None else options.dp_size,
        strict=options.strict,
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
