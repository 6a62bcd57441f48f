"""``python -m mbridge_mxfp8_plugin.launch``: a Bridge recipe script that can switch the plugin on.

Megatron-Bridge's own scripts (``scripts/training/run_recipe.py``, ``examples/recipes/...``) build
the job as: call a recipe function -> merge ``--config-file`` with OmegaConf -> apply trailing
Hydra overrides -> ``pretrain(config, forward_step)``. They take no callbacks, and Bridge drops an
``mxfp8_plugin:`` section with a warning its own log filter hides, so the job runs without the
plugin. This module is that script with two differences: the ``mxfp8_plugin`` section (file and
``mxfp8_plugin.*`` overrides) is split off before Bridge sees it and read as
:class:`~mbridge_mxfp8_plugin.options.PluginOptions`, and ``pretrain()`` gets
``callbacks=[MXFP8ParamSyncCallback(options)]`` when ``mxfp8_plugin.enabled`` is true.
Everything else is Bridge's code (``omegaconf_utils``), called in Bridge's order, so a file
means the same here as under Bridge's ``--config-file``; keys Bridge would skip with a
(filtered) warning are refused instead.

Usage (under ``torchrun --nproc_per_node=N -m mbridge_mxfp8_plugin.launch ...`` as well)::

    python -m mbridge_mxfp8_plugin.launch --recipe llama3_8b_pretrain_config \
        --config-file llama3_8b_mxfp8_pretrain train.train_iters=100 mxfp8_plugin.strict=false

Bad input exits 2 with one ``error:`` line (no traceback) naming the flag or key and the fix.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ._log import log_rank_zero, show_plugin_messages
from .errors import MXFP8ConfigError
from .options import PLUGIN_SECTION, PluginOptions, option_types

__all__ = ["Launch", "LaunchError", "main", "prepare"]

#: ``--forward-step`` default, Bridge's GPT step (its scripts' ``--step_func gpt_step``).
DEFAULT_FORWARD_STEP = "megatron.bridge.training.gpt_step:forward_step"
_FINETUNE_WORDS = ("finetune", "sft", "peft", "lora")


class LaunchError(MXFP8ConfigError):
    """Bad launcher input: one line naming the flag or key, the value, and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse prints usage + exits; we want one line
        raise LaunchError(f"{message} (see python -m mbridge_mxfp8_plugin.launch --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m mbridge_mxfp8_plugin.launch",
        description="Run Megatron-Bridge's pretrain() (or finetune()) from a recipe function, a YAML "
        "file and key=value overrides, with the MXFP8 param-sync plugin added when the "
        "mxfp8_plugin section enables it.",
        epilog="Trailing KEY=VALUE arguments are Hydra overrides of the ConfigContainer (e.g. "
        "train.train_iters=100) or of the plugin section (mxfp8_plugin.strict=false).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--recipe",
        required=True,
        help="recipe function returning a ConfigContainer: module:function, or the name of one in "
        "megatron.bridge.recipes (e.g. llama3_8b_pretrain_config); called with no arguments",
    )
    p.add_argument(
        "--config-file",
        "--config_file",
        dest="config_file",
        help="YAML merged onto the recipe as Bridge's --config-file does: a path or the name of a "
        "recipe shipped with the plugin (e.g. llama3_8b_mxfp8_pretrain)",
    )
    p.add_argument(
        "--mode",
        choices=("pretrain", "finetune"),
        help="default: finetune if the recipe name says finetune/sft/peft/lora, else pretrain",
    )
    p.add_argument(
        "--forward-step",
        "--forward_step",
        dest="forward_step",
        default=DEFAULT_FORWARD_STEP,
        help="module:function, or a module of megatron.bridge.training with a forward_step "
        "(gpt_step, vlm_step, llava_step); default: %(default)s",
    )
    return p


@dataclass
class Launch:
    """A job ready to run: what :func:`prepare` built from the command line."""

    config: Any
    options: PluginOptions
    forward_step: Callable[..., Any]
    mode: str
    #: the plugin's callback, or empty when ``mxfp8_plugin.enabled`` is false
    callbacks: list[Any] = field(default_factory=list)

    def run(self, extra_callbacks: Sequence[Any] = ()) -> None:
        """Bridge's ``pretrain``/``finetune`` with the plugin's callback first, then ``extra_callbacks``."""
        callbacks = [*self.callbacks, *extra_callbacks]
        if self.mode == "finetune":
            from megatron.bridge.training.finetune import finetune  # type: ignore[import-not-found]

            _check_finetune_takes_callbacks(finetune, callbacks)
            if callbacks:
                finetune(self.config, self.forward_step, callbacks=callbacks)
            else:
                finetune(self.config, self.forward_step)
            return
        from megatron.bridge.training.pretrain import pretrain  # type: ignore[import-not-found]

        pretrain(self.config, self.forward_step, callbacks=callbacks or None)


def _check_finetune_takes_callbacks(finetune: Callable[..., Any], callbacks: list[Any]) -> None:
    try:
        takes = "callbacks" in inspect.signature(finetune).parameters
    except (TypeError, ValueError):
        takes = True
    if takes or not callbacks:
        return
    raise LaunchError(
        f"--mode finetune: the installed Megatron-Bridge ({_bridge_version()}) has a finetune() "
        "without a callbacks parameter (added in 0.4.0), so the plugin cannot be added to it. "
        "Fix: upgrade megatron-bridge to >= 0.4.0, or run --mode pretrain with "
        "checkpoint.pretrained_checkpoint=PATH (0.3's finetune() is pretrain() after checking that "
        "a checkpoint to load is set), or set mxfp8_plugin.enabled=false to fine-tune without the plugin"
    )


def _bridge_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-bridge")
    except PackageNotFoundError:
        return "unknown version"


# --------------------------------------------------------------------------- overrides
def _override_key(text: str) -> str:
    key = text.split("=", 1)[0]
    return key.lstrip("+~")


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(bridge_overrides, plugin_overrides)``: those under ``mxfp8_plugin`` never reach Bridge."""
    bridge: list[str] = []
    plugin: list[str] = []
    for text in overrides:
        key = _override_key(text)
        (plugin if key == PLUGIN_SECTION or key.startswith(PLUGIN_SECTION + ".") else bridge).append(text)
    return bridge, plugin


def _check_override_syntax(overrides: Sequence[str]) -> None:
    for text in overrides:
        if text.startswith("-") and not text.startswith("~"):
            raise LaunchError(
                f"unknown option {text.split('=', 1)[0]!r}: the launcher takes --recipe, --config-file, "
                "--mode, --forward-step, then KEY=VALUE overrides"
            )
        if "=" not in text and not text.startswith("~"):
            raise LaunchError(
                f"{text!r} is not an override: trailing arguments are KEY=VALUE (e.g. train.train_iters=100) "
                "or ~KEY"
            )


def plugin_section(config_file: str | Path | None, plugin_overrides: Sequence[str]) -> PluginOptions:
    """The ``mxfp8_plugin`` section of the file with ``mxfp8_plugin.*`` overrides applied, validated.

    Read with the plugin's bounded reader (same OmegaConf and Hydra grammar as Bridge) before
    anything heavy is imported, so a typo in a knob fails in a second, not after Bridge's import.
    """
    section: dict[str, Any] = {}
    if config_file is not None:
        from .config.read import read_recipe_file

        recipe = read_recipe_file(config_file)
        raw = recipe.data.get(PLUGIN_SECTION)
        if raw is not None and not isinstance(raw, dict):
            raise LaunchError(
                f"{config_file}: {PLUGIN_SECTION} must be a mapping of plugin options, got {raw!r}"
            )
        section = dict(raw or {})
        refs = [k for k in recipe.base_refs if k.startswith(PLUGIN_SECTION + ".")]
        if refs:
            raise LaunchError(
                f"{config_file}: {refs[0]} is {recipe.base_refs[refs[0]]}, which the launcher cannot "
                "resolve before the job is built; write the value"
            )
    if plugin_overrides:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        types = option_types()
        for text in plugin_overrides:
            try:
                (override,) = parser.parse_overrides(overrides=[text])
            except Exception as exc:  # noqa: BLE001 - Hydra raises several types; all mean "bad syntax"
                raise LaunchError(f"override {text!r}: {str(exc).strip().splitlines()[0]}") from None
            parts = override.key_or_group.split(".")
            if len(parts) != 2:
                raise LaunchError(
                    f"override {text!r}: give one plugin option as {PLUGIN_SECTION}.NAME=VALUE "
                    f"(options: {', '.join(types)})"
                )
            name = parts[1]
            if override.is_delete():
                section.pop(name, None)
            else:
                section[name] = override.value()
    try:
        return PluginOptions.from_mapping(section)
    except MXFP8ConfigError as exc:
        raise LaunchError(str(exc)) from None


# --------------------------------------------------------------------------- names -> objects
def _import_attr(spec: str, flag: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise LaunchError(f"{flag} {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise LaunchError(f"{flag} {spec!r}: cannot import {exc.name or module_name!r} ({exc})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise LaunchError(f"{flag} {spec!r}: {module_name} has no {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise LaunchError(f"{flag} {spec!r}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def recipe_function(name: str) -> Callable[[], Any]:
    """``module:function``, or a recipe exported by ``megatron.bridge.recipes`` (as Bridge's script)."""
    if ":" in name:
        return _import_attr(name, "--recipe")  # type: ignore[no-any-return]
    recipes = importlib.import_module("megatron.bridge.recipes")
    if not callable(getattr(recipes, name, None)):
        known = [n for n in dir(recipes) if n.endswith("_config") and not n.startswith("_")]
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise LaunchError(
            f"--recipe {name!r}: megatron.bridge.recipes has no such recipe{hint} "
            "(or give your own as module:function)"
        )
    return getattr(recipes, name)  # type: ignore[no-any-return]


def forward_step_function(name: str) -> Callable[..., Any]:
    if ":" not in name:
        name = f"megatron.bridge.training.{name}:forward_step"
    return _import_attr(name, "--forward-step")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- Bridge's merge
def _unknown_keys(obj: Any, data: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys Bridge's ``apply_overrides`` would skip (with a WARNING its own filter hides)."""
    out = []
    names = {f.name for f in fields(obj)} if is_dataclass(obj) else set()
    for key, value in data.items():
        if key.startswith("_") and key.endswith("_"):  # _target_, _call_, ...: Bridge's instantiation
            continue
        if not hasattr(obj, key):
            close = difflib.get_close_matches(key, sorted(names), n=1)
            out.append(f"{prefix}{key}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
            continue
        current = getattr(obj, key)
        if is_dataclass(current) and isinstance(value, dict) and "_target_" not in value:
            out += _unknown_keys(current, value, f"{prefix}{key}.")
    return out


def merge_like_bridge(config: Any, config_file: str | Path | None, overrides: Sequence[str]) -> Any:
    """Bridge's ``process_config_with_overrides``, step by step, with the plugin section removed.

    Steps (``training/utils/omegaconf_utils.py``, 0.3 to 0.6): the container to OmegaConf
    (callables set aside), ``OmegaConf.load`` + ``OmegaConf.merge`` of the file, Hydra overrides
    in struct mode, resolve, apply back onto the dataclasses.
    """
    from megatron.bridge.training.utils import omegaconf_utils as ou  # type: ignore[import-not-found]
    from omegaconf import DictConfig, OmegaConf

    omega, excluded = ou.create_omegaconf_dict_config(config)
    if config_file is not None:
        yaml_conf = OmegaConf.load(config_file)
        if isinstance(yaml_conf, DictConfig) and PLUGIN_SECTION in yaml_conf:
            yaml_conf.pop(PLUGIN_SECTION)
        omega = OmegaConf.merge(omega, yaml_conf)
    if overrides:
        try:
            omega = ou.parse_hydra_overrides(omega, list(overrides))
        except ou.OverridesError as exc:
            cause = exc.__cause__ or exc
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise LaunchError(
                f"overrides {' '.join(overrides)}: {first} (a key the recipe lacks needs +KEY=VALUE)"
            ) from None
    final = OmegaConf.to_container(omega, resolve=True)
    assert isinstance(final, dict)
    unknown = _unknown_keys(config, {str(k): v for k, v in final.items()})
    if unknown:
        source = f"{config_file} / overrides" if config_file else "overrides"
        raise LaunchError(
            f"{source}: not a field of the recipe's ConfigContainer, Bridge would skip it: "
            f"{', '.join(unknown)}; fix the name"
        )
    ou.apply_overrides(config, final, excluded)
    return config


# --------------------------------------------------------------------------- entry points
def prepare(argv: Sequence[str]) -> Launch:
    """Parse ``argv``, read the plugin section, build and merge the config; raises :class:`LaunchError`."""
    args, rest = _parser().parse_known_args(list(argv))
    _check_override_syntax(rest)
    bridge_overrides, plugin_overrides = split_overrides(rest)
    config_file: Path | None = None
    if args.config_file is not None:
        from .recipe_files import resolve_recipe

        config_file = resolve_recipe(args.config_file)
        if not config_file.is_file():
            raise LaunchError(
                f"--config-file {args.config_file!r}: no such file and no shipped recipe of that name"
            )
    options = plugin_section(config_file, plugin_overrides)
    mode = args.mode or ("finetune" if any(w in args.recipe.lower() for w in _FINETUNE_WORDS) else "pretrain")
    make_config = recipe_function(args.recipe)
    if mode == "finetune" and options.enabled:  # refuse before the (long) config build
        from megatron.bridge.training.finetune import finetune  # type: ignore[import-not-found]

        _check_finetune_takes_callbacks(finetune, ["plugin"])
    forward_step = forward_step_function(args.forward_step)
    config = make_config()
    if not all(hasattr(config, s) for s in ("model", "train", "optimizer")):
        raise LaunchError(
            f"--recipe {args.recipe!r} returned a {type(config).__name__}, not a ConfigContainer"
        )
    merge_like_bridge(config, config_file, bridge_overrides)
    callbacks: list[Any] = []
    if options.enabled:
        from .bridge import MXFP8ParamSyncCallback

        callbacks.append(MXFP8ParamSyncCallback(options))
    log_rank_zero(
        logging.INFO,
        "launch: %s with %s (%s); MXFP8 param-sync plugin %s",
        mode,
        args.recipe,
        config_file or "no --config-file",
        "enabled" if options.enabled else "disabled by mxfp8_plugin.enabled=false",
    )
    return Launch(config, options, forward_step, mode, callbacks)


def main(argv: Sequence[str] | None = None, *, callbacks: Sequence[Any] = ()) -> int:
    """Run the job; 0 when it finished, 2 (one ``error:`` line, rank 0 only) for bad input.

    ``callbacks`` run after the plugin's (e.g. a script's own loggers, or a test's recorder).
    """
    show_plugin_messages()
    try:
        prepare(sys.argv[1:] if argv is None else argv).run(callbacks)
    except MXFP8ConfigError as exc:  # LaunchError, RecipeError, a strict config-rule failure
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
