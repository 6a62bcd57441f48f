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
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.exit_codes import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED
from ..common.log import log_rank_zero, show_plugin_messages
from ..config.read import RecipeError, RecipeInput, compose, merge_onto_container, plugin_section
from ..errors import MXFP8ConfigError
from ..options import PLUGIN_SECTION, PluginOptions
from .check import credit

__all__ = ["Launch", "LaunchError", "main", "plugin_options", "prepare"]

#: ``--forward-step`` default, Bridge's GPT step (its scripts' ``--step_func gpt_step``).
DEFAULT_FORWARD_STEP = "megatron.bridge.training.gpt_step:forward_step"
_FINETUNE_WORDS = ("finetune", "sft", "peft", "lora")


class LaunchError(MXFP8ConfigError):
    """Bad launcher input or a missing package: one line naming the flag or key, the value, and the fix."""


class CheckRefused(MXFP8ConfigError):
    """``check``'s error on the launcher's inputs (a key or a value it knows to be wrong, or, under
    ``strict``, any rule error): exit 1, as ``check`` exits on the same inputs, not 2."""


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


def _base_recipe(name: str) -> Any:
    """The recipe function's source facts for ``check``'s input rules (read, not imported), or
    None where the recipe is the user's own or its source says nothing."""
    from ..probes.recipe_source import find_recipe

    try:
        return find_recipe(name.replace(":", "."))
    except Exception:  # noqa: BLE001 - a reader of upstream source: no verdict is "not known"
        return None


def _container_facts(config: Any, recipe_name: str) -> Any:
    """The recipe's facts as ``check --recipe`` reads them from source, but off the built
    container: its model class and ``comm_overlap`` section, and the model knobs it holds."""
    from ..probes.recipe_source import recipe_facts

    facts = recipe_facts(config, recipe_name)
    model = getattr(config, "model", None)
    fields = getattr(model, "__dataclass_fields__", {})
    scalars = {k: getattr(model, k, None) for k in fields}
    facts.model.update(
        {k: v for k, v in scalars.items() if v is None or isinstance(v, (bool, int, float, str))}
    )
    return facts


def _check_input(
    recipe: RecipeInput, overrides: Sequence[str], options: PluginOptions, recipe_name: str, base: Any = None
) -> Any:
    """``check``'s rules on the file and overrides: a key or a type it knows to be wrong cannot be
    applied faithfully, so it stops the launch here, in a second, with the first error. Run again
    once the recipe function has built its container, with ``base`` read off that container (its
    model class, its ``comm_overlap``): ``check --recipe`` reads the same facts from the source."""
    from ..config.validate import validate_config

    report = validate_config(
        recipe.data,
        dp_size=options.dp_size,
        strict=False,
        skipped=recipe.not_checked(),
        base_recipe=_base_recipe(recipe_name) if base is None else base,
    )
    structural = [f for f in report.errors if f.rule.startswith("MX1")]
    if structural:
        more = (
            f" (and {len(structural) - 1} more: mxfp8-plugin check shows them all)" if structural[1:] else ""
        )
        raise CheckRefused(f"{credit(recipe.path, overrides, structural[0])}: {structural[0].line()}{more}")
    return report


# --------------------------------------------------------------------------- names -> objects
class _ImportFailed(LaunchError):
    """An import of Bridge, the recipe or the forward step failed (one line already says which
    package): :func:`_held_import_output` drops the import output it held."""


def _transformer_engine_missing() -> bool:
    """No ``transformer_engine`` on ``sys.path``: ``find_spec`` on a top-level name runs no TE
    code, so a TE that is present but broken (its CUDA libraries) counts as present here."""
    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):  # a module without __spec__ in sys.modules: not missing
        return False


class _HeldStderr:
    """``sys.stderr`` while the imports run: keeps what is written (text, and warnings as
    :class:`warnings.WarningMessage`) until :meth:`release`, then writes through to the stream it
    replaced. A handler made during the imports (torch's loggers bind ``sys.stderr`` then) keeps
    this object as its stream, so after the release it still reaches the real one."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.held: list[str | warnings.WarningMessage] | None = []

    def write(self, text: str) -> int:
        if self.held is None:
            return int(self._real.write(text))
        self.held.append(text)
        return len(text)

    def flush(self) -> None:
        if self.held is None:
            self._real.flush()

    def hold_warning(self, *args: Any, **kwargs: Any) -> None:
        """``warnings.showwarning`` while held: the warning itself, to tell TE's apart."""
        if self.held is None:
            return
        self.held.append(warnings.WarningMessage(*args, **kwargs))

    def release(self, show: bool) -> list[str | warnings.WarningMessage]:
        held, self.held = self.held or [], None
        for item in held if show else ():
            if isinstance(item, str):
                self._real.write(item)
            else:
                warnings.showwarning(item.message, item.category, item.filename, item.lineno, item.file)
        return held

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, buffer, ...
        return getattr(self._real, name)


def _about_te(item: str | warnings.WarningMessage) -> bool:
    """A warning that Transformer Engine is missing: what the ``error:`` line says too."""
    if isinstance(item, str):
        return False
    text = str(item.message).lower()
    return "transformer engine" in text or "transformer_engine" in text


@contextlib.contextmanager
def _held_import_output() -> Iterator[None]:
    """Where Transformer Engine is not installed, megatron-core warns as Bridge imports it, once
    per module, that TE and Apex are missing (4 UserWarnings, 8 lines, with core 0.16; Bridge 0.6
    also logs a traceback it catches), and then Bridge's import fails on TE and the launcher's
    ``error:`` line says so: all that output only restates it, above it. So stderr is held while
    the imports run: dropped when one fails (one note line counts what was not about TE), written
    out as it came when they succeed (a Bridge that imports without TE). Nothing is held where TE
    is installed, nor where the user set warning filters (``-W``; ``PYTHONWARNINGS=default`` shows
    it all)."""
    if sys.warnoptions or not _transformer_engine_missing():
        yield
        return
    real = sys.stderr
    hold = _HeldStderr(real)
    failed: _ImportFailed | None = None
    try:
        with warnings.catch_warnings():
            warnings.showwarning = hold.hold_warning
            sys.stderr = hold  # type: ignore[assignment]
            try:
                yield
            except _ImportFailed as exc:
                failed = exc
            finally:
                if sys.stderr is hold:
                    sys.stderr = real
    finally:
        held = hold.release(show=failed is None)  # an exception that is not ours: shown, as a success
    if failed is None:
        return
    warned = sum(1 for item in held if not isinstance(item, str) and not _about_te(item))
    logged = sum(len(item.strip().splitlines()) for item in held if isinstance(item, str))
    if not warned and not logged:
        raise failed
    counts = f"{warned} other import warning{'s' * (warned != 1)}, {logged} log line{'s' * (logged != 1)}"
    note = f"(held back: {counts}; PYTHONWARNINGS=default shows them)"
    raise _ImportFailed(f"{failed}\n{note}") from None


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
    file_report = _check_input(early, rest, options, args.recipe)
    mode = args.mode or ("finetune" if any(w in args.recipe.lower() for w in _FINETUNE_WORDS) else "pretrain")
    with _held_import_output():  # no Transformer Engine: its absence is said once, not 8 times
        make_config = recipe_function(args.recipe)
        entry = _entry(mode)
        if mode == "finetune" and options.enabled:  # refuse before the (long) config build
            _check_finetune_takes_callbacks(entry, ["plugin"])
        forward_step = forward_step_function(args.forward_step)
        config = _build_config(make_config, args.recipe)
    base = _container_facts(config, args.recipe)  # what the recipe function set, before the merge
    merge_onto_container(config, files, rest)
    file_report = _check_input(early, rest, options, args.recipe, base=base)
    callbacks: list[Any] = []
    if options.enabled:
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
