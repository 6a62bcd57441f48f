"""The plugin's options: one dataclass behind every entry point.

``MXFP8ParamSyncCallback(options)``, ``MXFP8ParamSyncLightningCallback(options)``,
``mxfp8_param_sync(model, optimizer, options)``, a recipe's ``mxfp8_plugin:`` section and
``check``'s schema all read :class:`PluginOptions`, so an option added here exists everywhere at
once, with the same default. Nothing in this module imports torch or a training framework:
``check`` reads it on a login node.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MXFP8ConfigError, MXFP8UsageError

__all__ = ["DEFAULT_VERIFY_SAMPLE", "PLUGIN_SECTION", "PluginOptions", "option_problem", "option_types"]

#: The plugin's own section in a recipe YAML; split off before Bridge sees the rest.
PLUGIN_SECTION = "mxfp8_plugin"

#: Fraction of MXFP8 blocks the weight check compares by default (every 16th, rotating).
DEFAULT_VERIFY_SAMPLE = 0.0625


class _OptionsDoc(type):
    """``PluginOptions.__doc__`` with every option's docstring, made when asked (``help()``, the
    docs), not at import: reading them parses this file, which ``check`` would pay on every run."""

    @property
    def __doc__(cls) -> str | None:  # type: ignore[override]
        doc = cls.__dict__.get("_full_doc")
        if doc is None and not _BUILDING:
            doc = _with_option_docs(cls.__dict__.get("__doc__"))
            type.__setattr__(cls, "_full_doc", doc)
        return doc if doc is not None else cls.__dict__.get("__doc__")


_BUILDING = True  # the dataclass decorator reads __doc__ before the class has a name


@dataclass(frozen=True)
class PluginOptions(metaclass=_OptionsDoc):
    """How the plugin runs. Defaults are the safe choice on every release pair.

    An option that names one framework is read only by that framework's entry point (the others
    have no such event); every other option is honoured by all three.
    """

    enabled: bool = True
    """Run the plugin at all. ``False`` makes every entry point inert (no engine, no hook does
    anything; one rank-zero log line), and ``callbacks_from_recipe`` returns no callback; check's
    MX009 says whether the installed release then trains on stale or polluted weights."""

    strict: bool = True
    """Refuse to start when the train-start config check finds an error (``False``: log it and go on)."""

    validate: bool = True
    """Check the job's config at train start: Bridge's ``ConfigContainer`` when there is one, else
    the live megatron-core configs the chunks and the distributed optimizer run with."""

    repair_alignment: bool = True
    """Rewrite bucket offsets that ignore the 64-element padding (defect A) at train start;
    ``False`` raises on a wrong offset instead."""

    prestage: bool = True
    """Stage main params ahead of a forced sync the loop is about to issue, so the framework's own
    all-gather collects weights (``False``: gather again at eval start, one extra all-gather per
    eval). Bridge only: the other loops announce no forced sync in advance."""

    guard_exit_saves: bool = True
    """Bridge only: with ``exit_signal_handler`` or ``exit_duration_in_mins`` on, vote each step
    (one 1-element all-reduce) on whether an exit save may follow, and prepare the weights for it.
    ``False``: such saves may hold gradients (core 0.18/0.19 with Bridge < 0.6) or the previous
    step's weights (core < 0.18)."""

    refresh_at_train_end: bool = True
    """Make the weights current after the training loop, for export or test after training."""

    stage_for_nemo_steps: bool = True
    """Lightning only: stage main params at NeMo 2's ``on_megatron_microbatches_start``, since
    NeMo never stages them itself. Turn off only for a Lightning loop that stages them."""

    verify_weights: bool = False
    """Check the weights at the events where they must be current and the entry point sees them
    (eval and test start, checkpoint saves and loads, train end; which ones per entry point, and
    with ``enabled=False``: docs/verify.md): each rank compares the MXFP8 params it owns with the
    quantization of its fp32 main-param shard, and data-parallel replicas are compared through one
    small all-reduce (:func:`~mbridge_mxfp8_plugin.verify_weights`). A mismatch raises with
    ``strict``, else is logged at ERROR. Only reads, so it also guards the releases where the
    plugin has nothing to fix. Off by default; what it costs and when to switch it on:
    docs/verify.md."""

    verify_sample: float = DEFAULT_VERIFY_SAMPLE
    """Fraction of the 32-element blocks of each owned param slice that ``verify_weights``
    compares per check (every ``round(1/verify_sample)``-th block, at least one per param, the
    phase rotating each call so the whole model is covered within that many checks); also the
    fraction of rows folded for the replica check. The defects it guards against change nearly
    every block, so a sample finds them at its first check; ``1.0`` compares every block. Must be
    in (0, 1]. A sample reads fewer bytes, but its time does not shrink in proportion (measured:
    docs/verify.md)."""

    verify_accept_unchecked: bool = False
    """Take a ``verify_weights`` check that could not read an MXFP8 weight's type (NOT CHECKED) as
    a pass. By default NOT CHECKED is a failure (raised with ``strict``, else logged at ERROR):
    the check cannot vouch for the weights the defects corrupt. docs/verify.md names the types it
    reads; turn this on for a type it does not, once you know why."""

    dp_size: int | None = None
    """Data-parallel size the job will run with; read only by check's padding rule (MX008)."""

    def __post_init__(self) -> None:
        # Every constructor path (keywords, ``replace``, ``from_mapping``) lands here, so
        # ``MXFP8ParamSyncCallback(strict='no')`` is refused with the message YAML gets.
        found = (option_problem(f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        problems = [p for p in found if p]
        if problems:
            raise MXFP8ConfigError("; ".join(problems))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> PluginOptions:
        """Strict: an unknown option or a wrongly typed value is an error, not a silent default."""
        data = dict(data or {})
        problems = [p for key, value in data.items() if (p := option_problem(str(key), value))]
        if problems:
            raise MXFP8ConfigError("; ".join(problems))
        return cls(**data)

    def replace(self, **changes: Any) -> PluginOptions:
        """These options with the given ones changed; ``None`` values mean "keep".

        The one path by which every entry point's keyword overrides reach its options; an unknown
        name is a usage error rather than a silently ignored keyword.
        """
        _refuse_unknown(changes)
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Ranges beyond the type: (test, what the value must be).
_RANGES: dict[str, tuple[Any, str]] = {
    "verify_sample": (lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "dp_size": (lambda v: v is None or v >= 1, "an integer >= 1, or null"),
}


def option_problem(name: str, value: Any) -> str | None:
    """The one validator of a plugin option, used by YAML, overrides, the launcher and every
    constructor: None when ``value`` is acceptable, else one line naming the option, the value
    and what it must be."""
    from .common.yamltypes import suggest, type_problem

    types = option_types()
    key = f"{PLUGIN_SECTION}.{name}"
    if name not in types:
        return f"{key} is not a plugin option{suggest(name, types)} (options: {', '.join(types)})"
    expected = type_problem(value, types[name])
    if expected is None and name in _RANGES and not _RANGES[name][0](value):
        expected = _RANGES[name][1]
    if expected is None:
        return None
    return f"{key} must be {expected}, got {value!r} ({type(value).__name__})"


def option_types() -> dict[str, Any]:
    """Option name -> type, for the ``mxfp8_plugin:`` section's schema."""
    hints = {"bool": bool, "int | None": int | None, "float": float}
    return {f.name: hints[str(f.type)] for f in dataclasses.fields(PluginOptions)}


def option_docs() -> dict[str, str]:
    """Option name -> its field docstring, read from this file's source with ``ast``.

    The docstrings under the fields are the one description of each option: ``help(PluginOptions)``
    shows them (appended to the class docstring below) and the docs' option tables are rendered
    from them. Empty where the source is not shipped (a ``.pyc``-only install).
    """
    import ast
    from pathlib import Path

    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == PluginOptions.__name__)
    docs = {}
    for node, after in zip(cls.body[:-1], cls.body[1:], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _with_option_docs(doc: str | None) -> str:
    # help() shows __doc__; the field docstrings are no attributes, so fold them in once here.
    defaults = {f.name: f.default for f in dataclasses.fields(PluginOptions)}
    lines = [f"{name} (default {defaults[name]!r}): {text}" for name, text in option_docs().items()]
    return (doc or "").rstrip() + "\n\nOptions:\n\n" + "\n\n".join(lines) + "\n"


_BUILDING = False


def _refuse_unknown(names: Any) -> None:
    """A misspelt keyword names the option it was probably meant to be, as YAML keys do."""
    from .common.yamltypes import suggest

    types = option_types()
    unknown = sorted(set(names) - set(types))
    if unknown:
        raise MXFP8UsageError(
            f"not a plugin option: {', '.join(unknown)}{suggest(unknown[0], types)} "
            f"(options: {', '.join(types)})"
        )


_dataclass_init = PluginOptions.__init__


@functools.wraps(_dataclass_init)
def _init_naming_unknown_keywords(self: PluginOptions, *args: Any, **kwargs: Any) -> None:
    # The dataclass's own __init__ would raise a bare TypeError without a suggestion.
    _refuse_unknown(kwargs)
    _dataclass_init(self, *args, **kwargs)


PluginOptions.__init__ = _init_naming_unknown_keywords  # type: ignore[method-assign]
