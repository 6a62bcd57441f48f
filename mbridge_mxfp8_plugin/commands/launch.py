"""``python -m mbridge_mxfp8_plugin.launch``: a Bridge recipe script that can switch the plugin on.

Megatron-Bridge's own scripts (``scripts/training/run_recipe.py``, ``examples/recipes/...``) build
the job as: call a recipe function -> merge ``--config-file`` with OmegaConf -> apply trailing
Hydra overrides -> ``pretrain(config, forward_step)``. They take no callbacks, and Bridge drops an
``mxfp8_plugin:`` section with a warning its own log filter hides, so the job runs without the
plugin. This module is that script with two differences: the ``mxfp8_plugin`` section (file and
``mxfp8_plugin.*`` overrides) is split off before Bridge sees it and read as
:class:`~mbridge_mxfp8_plugin.options.PluginOptions`, and ``pretrain()`` gets
``callbacks=[MXFP8ParamSyncCallback(options)]`` when ``mxfp8_plugin.enabled`` is true. The merge
is Bridge's own code (:func:`.config.read.merge_onto_container`), so a file means the same here
as under Bridge's ``--config-file``; keys Bridge would skip with a (filtered) warning are refused.

Order matters for a user waiting on a queue: the file, the overrides, the plugin options and
``check``'s input rules are judged first, in a second, before Bridge (tens of seconds to import,
and Transformer Engine under it) is touched; then Bridge, the recipe and the forward step are
imported, each failure one line naming what is missing and how to install it. ``--dry-run``
stops after building the job and prints what a run would start with (:mod:`._launch_report`).

Usage (under ``torchrun --nproc_per_node=N -m mbridge_mxfp8_plugin.launch ...`` as well)::

    python -m mbridge_mxfp8_plugin.launch --recipe llama3_8b_pretrain_config \
        --config-file llama3_8b_mxfp8_pretrain train.train_iters=100 mxfp8_plugin.strict=false

Exit status (:mod:`..common.exit_codes`, the table ``check`` uses too): 0 the job ran (or, with
``--dry-run``, would start); 1 ``check``'s rules on the inputs or the train-start config check
refused it (or, with ``--dry-run``, would), as ``check`` exits 1 on the same inputs; 2 input that
cannot be read (arguments, a missing file) or a missing package, one ``error:`` line.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.exit_codes import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED
from ..common.log import log_rank_zero, show_plugin_messages
from ..config.read import RecipeError, RecipeInput, compose, merge_onto_container, plugin_section
from ..errors import MXFP8ConfigError
from ..options import PLUGIN_SECTION, PluginOptions
from .held_imports import ImportFailed, held_import_output
from .launch_check import CheckRefused, check_inputs, container_facts

__all__ = ["Launch", "LaunchError", "main", "plugin_options", "prepare"]

#: ``--forward-step`` default, Bridge's GPT step (its scripts' ``--step_func gpt_step``).
DEFAULT_FORWARD_STEP = "megatron.bridge.training.gpt_step:forward_step"
_FINETUNE_WORDS = ("finetune", "sft", "peft", "lora")


class LaunchError(MXFP8ConfigError):
    """Bad launcher input or a missing package: one line naming the flag or key, the value, and the fix."""


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
    p.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="build the job exactly as a run would, run the config checks, print the plugin options "
        "and the MXFP8 knobs, and exit without training (0: it would start, 1: the train-start "
        "check would refuse it)",
    )
    return p


@dataclass
class Launch:
    """A job ready to run: what :func:`prepare` built from the command line."""

    config: Any
    options: PluginOptions
    forward_step: Callable[..., Any]
    mode: str
    #: Bridge's ``pretrain`` or ``finetune``, imported while the job was built
    entry: Callable[..., Any]
    #: the plugin's callback, or empty when ``mxfp8_plugin.enabled`` is false
    callbacks: list[Any] = field(default_factory=list)
    #: the file and overrides as read before the recipe was built (for ``--dry-run``'s report)
    recipe: RecipeInput | None = None
    #: ``check``'s report on the file and overrides (input rules; the job's own check runs at train start)
    file_report: Any = None
    #: what is launched, in words: mode, recipe, file
    summary: str = ""
    #: ``--dry-run``: report the job instead of running it
    dry_run: bool = False

    def refuses_on_errors(self) -> bool:
        """Whether a config error stops this job: the plugin's callback runs the train-start check
        (``enabled``), the check is on (``validate``) and refuses (``strict``)."""
        return self.options.enabled and self.options.validate and self.options.strict

    def file_refusal(self) -> list[Any]:
        """``check``'s errors on the file and overrides that make a strict run refuse to start:
        ``check`` and the launcher are one judge, so what ``check`` calls an error on these
        inputs stops the job here as the train-start check would (exit 1 either way)."""
        if self.file_report is None or not self.refuses_on_errors():
            return []
        return list(self.file_report.errors)

    def run(self, extra_callbacks: Sequence[Any] = ()) -> None:
        """Bridge's ``pretrain``/``finetune`` with the plugin's callback first, then ``extra_callbacks``."""
        errors = self.file_refusal()
        if errors:
            more = f" (and {len(errors) - 1} more: mxfp8-plugin check shows them all)" if errors[1:] else ""
            raise CheckRefused(
                f"the config check refused this job (mxfp8_plugin.strict is true): {errors[0].line()}{more}; "
                "fix it, or set mxfp8_plugin.strict=false to log it and train"
            )
        callbacks = [*self.callbacks, *extra_callbacks]
        if self.mode == "finetune":
            _check_finetune_takes_callbacks(self.entry, callbacks)
            if callbacks:
                self.entry(self.config, self.forward_step, callbacks=callbacks)
            else:  # Bridge 0.3's finetune() has no callbacks parameter
                self.entry(self.config, self.forward_step)
            return
        self.entry(self.config, self.forward_step, callbacks=callbacks or None)


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


# --------------------------------------------------------------------------- before any heavy import
def _check_override_syntax(overrides: Sequence[str]) -> None:
    for text in overrides:
        if text.startswith("-") and not text.startswith("~"):
            raise LaunchError(
                f"unknown option {text.split('=', 1)[0]!r}: the launcher takes --recipe, --config-file, "
                "--mode, --forward-step, --dry-run, then KEY=VALUE overrides"
            )
        if "=" not in text and not text.startswith("~"):
            raise LaunchError(
                f"{text!r} is not an override: trailing arguments are KEY=VALUE (e.g. train.train_iters=100) "
                "or ~KEY"
            )


def _options_of(recipe: RecipeInput) -> PluginOptions:
    recipe.require_resolved(
        PLUGIN_SECTION + ".",
        fix="the launcher reads plugin options before the recipe exists; write the value",
    )
    return PluginOptions.from_mapping(plugin_section(recipe.data, recipe.path)[1])


def plugin_options(config_file: str | Path | None, overrides: Sequence[str] = ()) -> PluginOptions:
    """The options the job will run with: the file's ``mxfp8_plugin`` section with the
    ``mxfp8_plugin.*`` overrides applied (other overrides are read too, and must parse)."""
    return _options_of(compose([config_file] if config_file is not None else [], overrides))


# --------------------------------------------------------------------------- names -> objects
class _ImportFailed(LaunchError, ImportFailed):
    """An import of Bridge, the recipe or the forward step failed (one line already says which
    package): :func:`.held_imports.held_import_output` drops the import output it held."""


def _import(module: str, what: str) -> Any:
    """``importlib.import_module``, any failure one line (:func:`._missing.import_failure`)."""
    from ..common.missing import import_failure

    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - an import can raise anything (TE: OSError, RuntimeError)
        raise _ImportFailed(import_failure(exc, what, module)) from None


def _import_attr(spec: str, flag: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise LaunchError(f"{flag} {spec!r}: expected module:function")
    obj = _import(module_name, f"{flag} {spec!r}")
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
    recipes = _import("megatron.bridge.recipes", f"--recipe {name}")
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


def _entry(mode: str) -> Callable[..., Any]:
    """Bridge's ``pretrain`` or ``finetune``: importing it is importing Bridge's training stack."""
    module = _import(f"megatron.bridge.training.{mode}", f"megatron.bridge.training.{mode}")
    return getattr(module, mode)  # type: ignore[no-any-return]


def _build_config(make_config: Callable[[], Any], name: str) -> Any:
    try:
        config = make_config()
    except ImportError as exc:  # the recipe imports lazily (a provider, a tokenizer): same one line
        from ..common.missing import import_failure

        raise _ImportFailed(
            import_failure(exc, f"--recipe {name}", getattr(exc, "name", None) or name)
        ) from None
    if not all(hasattr(config, s) for s in ("model", "train", "optimizer")):
        raise LaunchError(f"--recipe {name!r} returned a {type(config).__name__}, not a ConfigContainer")
    return config


# --------------------------------------------------------------------------- entry points
def prepare(argv: Sequence[str]) -> Launch:
    """Parse ``argv`` and build the job as a run does; raises :class:`LaunchError` (or the reader's
    ``RecipeError``) with one line."""
    args, rest = _parser().parse_known_args(list(argv))
    _check_override_syntax(rest)
    files: list[Path] = []
    if args.config_file is not None:
        from ..config.recipe_files import resolve_recipe

        files.append(resolve_recipe(args.config_file))
        if not files[0].is_file():
            raise LaunchError(
                f"--config-file {args.config_file!r}: no such file and no shipped recipe of that name"
            )
    early = compose(files, rest)  # no recipe yet: what only the recipe decides is left unchecked
    options = _options_of(early)
    file_report = check_inputs(early, rest, options, args.recipe)
    mode = args.mode or ("finetune" if any(w in args.recipe.lower() for w in _FINETUNE_WORDS) else "pretrain")
    with held_import_output():  # no Transformer Engine: its absence is said once, not 8 times
        make_config = recipe_function(args.recipe)
        entry = _entry(mode)
        if mode == "finetune" and options.enabled:  # refuse before the (long) config build
            _check_finetune_takes_callbacks(entry, ["plugin"])
        forward_step = forward_step_function(args.forward_step)
        config = _build_config(make_config, args.recipe)
    base = container_facts(config, args.recipe)  # what the recipe function set, before the merge
    merge_onto_container(config, files, rest)
    file_report = check_inputs(early, rest, options, args.recipe, base=base)
    callbacks: list[Any] = []
    if options.enabled or options.verify_weights:  # disabled, the callback still checks the weights
        from ..adapters.bridge import MXFP8ParamSyncCallback

        callbacks.append(MXFP8ParamSyncCallback(options))
    summary = f"{mode} with {args.recipe} ({files[0] if files else 'no --config-file'})"
    state = "enabled" if options.enabled else "disabled by mxfp8_plugin.enabled=false"
    log_rank_zero(logging.INFO, "launch: %s; MXFP8 param-sync plugin %s", summary, state)
    return Launch(
        config, options, forward_step, mode, entry, callbacks, early, file_report, summary, args.dry_run
    )


def main(argv: Sequence[str] | None = None, *, callbacks: Sequence[Any] = ()) -> int:
    """Run the job (or, with ``--dry-run``, report it); the exit status is the module docstring's.

    ``callbacks`` run after the plugin's (e.g. a script's own loggers, or a test's recorder).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    show_plugin_messages()
    rank_zero = os.environ.get("RANK", "0") == "0"
    try:
        launch = prepare(argv)
    except CheckRefused as exc:  # check's verdict on these inputs: its exit status
        return _fail(exc, EXIT_REFUSED, rank_zero)
    except MXFP8ConfigError as exc:  # the input (arguments, file, plugin options), before a job exists
        return _fail(exc, EXIT_BAD_INPUT, rank_zero)
    try:
        if launch.dry_run:
            from .launch_report import dry_run

            return dry_run(launch, sys.stdout if rank_zero else None)
        launch.run(callbacks)
    except (LaunchError, RecipeError) as exc:  # still the input (e.g. a finetune entry without callbacks)
        return _fail(exc, EXIT_BAD_INPUT, rank_zero)
    except MXFP8ConfigError as exc:  # the callback's train-start check refused the job (strict)
        return _fail(exc, EXIT_REFUSED, rank_zero)
    return EXIT_OK


def _fail(exc: Exception, status: int, rank_zero: bool) -> int:
    if rank_zero:
        print(f"error: {exc}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
