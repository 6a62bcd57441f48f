"""``mxfp8-plugin check RECIPE.yaml [dotted.key=value ...] [--recipe NAME] [--dp-size N] [--json]``.

Meant for a login node or CI, before a job is queued: needs neither GPUs nor Transformer
Engine nor an importable Megatron-Bridge, and imports neither torch nor megatron-core (the
installed releases are read from their files). The recipe is read with Megatron-Bridge's own
readers, OmegaConf and Hydra's override grammar (:mod:`.config.read`). ``--recipe`` names the
Bridge recipe function the file is merged onto, read from its source: the model provider class
it builds (so a key that is not one of its fields is an error, not a warning) and the model
knobs it sets (experts: MoE). Exit codes: 0 no errors (warnings allowed unless
``--fail-on-warning``, rules that could not judge allowed unless ``--fail-on-unchecked``), 1 the
config has errors, 2 the input could not be read. Never a traceback for bad input: every
message names the file or knob and says what was expected.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..common.argtypes import positive_int
from ..common.exit_codes import EXIT_BAD_INPUT as EXIT_UNREADABLE
from ..common.exit_codes import EXIT_OK
from ..common.exit_codes import EXIT_REFUSED as EXIT_ERRORS

__all__ = ["add_check_parser", "credit", "existing_addition", "run_check"]


#: A Hydra override's key: dotted identifiers (``+``/``++`` to add, ``~`` to delete).
_OVERRIDE_KEY = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w-]*(\.[A-Za-z_0-9][\w-]*)*$")


def _override(text: str) -> str:
    """An argparse ``type``: Hydra's override forms, so a stray word or an empty key (``=``) is
    named here in one line (exit 2) instead of reaching Hydra, which would add a key named ''."""
    key, eq, _ = text.partition("=")
    if (eq or key.startswith("~")) and _OVERRIDE_KEY.match(key):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an override: expected dotted.key=value (or +key=value to add, ~key to delete)"
    )


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "check",
        help="validate a recipe YAML for MXFP8 param gather (exit 0 ok, 1 errors, 2 could not read it)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "recipe",
        help="recipe YAML (Megatron-Bridge override format + mxfp8_plugin section), "
        "or the name of a shipped recipe, e.g. tiny_debug_mxfp8",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # else argparse lists it as required when the recipe is missing
        type=_override,
        help="Hydra-style overrides, before or after the options: dotted.key=value, +key=value, ~key",
    )
    parser.add_argument(
        "--dp-size",
        type=positive_int("--dp-size", 8),
        default=None,
        metavar="N",
        help="data-parallel size, for the padding rule",
    )
    parser.add_argument(
        "--recipe",
        dest="base_recipe",
        default=None,
        metavar="NAME",
        help="the Bridge recipe function the file is merged onto (e.g. qwen3_30b_a3b_pretrain_config, "
        "its dotted path, or your own as module:function / path/to/file.py:function, as the launcher "
        "takes it): its model class and the model knobs it sets are read from its source, not run",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fail-on-warning", action="store_true", help="exit 1 on warnings too (for CI)")
    parser.add_argument(
        "--fail-on-unchecked",
        action="store_true",
        help="exit 1 when any rule could not judge the config (n/a), e.g. a knob the base recipe decides",
    )
    parser.set_defaults(func=_cmd_check)
    return parser


def _cmd_check(args: argparse.Namespace) -> int:
    return run_check(
        args.recipe,
        args.overrides,
        dp_size=args.dp_size,
        as_json=args.json,
        fail_on_warning=args.fail_on_warning,
        fail_on_unchecked=args.fail_on_unchecked,
        recipe_name=args.base_recipe,
    )


def run_check(
    recipe: str,
    overrides: list[str] | None = None,
    *,
    dp_size: int | None = None,
    as_json: bool = False,
    fail_on_warning: bool = False,
    fail_on_unchecked: bool = False,
    recipe_name: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    installed: Any = None,
) -> int:
    """The command's body, callable from tests; returns the exit code."""
    from ..config.read import RecipeError, read_recipe_file
    from ..config.recipe_files import resolve_recipe  # a path, or a shipped recipe's name
    from ..errors import MXFP8PluginError

    out = out or sys.stdout
    err = err or sys.stderr
    if dp_size is not None and dp_size < 1:
        _emit_unreadable(f"--dp-size must be >= 1, got {dp_size}", as_json, out, err)
        return EXIT_UNREADABLE
    bad = [o for o in overrides or () if not _is_override(o)]
    if bad:
        _emit_unreadable(f"{bad[0]!r} is not an override: expected dotted.key=value", as_json, out, err)
        return EXIT_UNREADABLE
    try:
        recipe_input = read_recipe_file(resolve_recipe(recipe), overrides or ())
    except RecipeError as exc:
        _emit_unreadable(str(exc), as_json, out, err)
        return EXIT_UNREADABLE
    missing = _missing_deletion(recipe_input.base_deletions)
    if missing:
        _emit_unreadable(missing, as_json, out, err)
        return EXIT_UNREADABLE
    base = _base_recipe(recipe_name)
    if isinstance(base, str):
        _emit_unreadable(base, as_json, out, err)
        return EXIT_UNREADABLE
    present = missing_override(overrides or [], base) or existing_addition(overrides or [], base)
    if present:
        _emit_unreadable(present, as_json, out, err)
        return EXIT_UNREADABLE
    from ..config.validate import validate_config

    try:
        report = validate_config(
            recipe_input.data,
            dp_size=dp_size,
            strict=False,
            installed=installed,
            skipped=recipe_input.not_checked(),
            base_recipe=base,
        )
    except MXFP8PluginError as exc:  # pragma: no cover - read_config raises only for programming errors
        _emit_unreadable(str(exc), as_json, out, err)
        return EXIT_UNREADABLE
    if as_json:
        payload = report.as_dict()
        payload["recipe"] = recipe
        payload["base_recipe"] = None if base is None else {"name": base.name, "provider": base.provider}
        out.write(_json(payload, indent=2) + "\n")
    else:
        shown = [
            recipe,
            *(overrides or []),
            *(["--recipe", recipe_name] if recipe_name else []),
            *(["--dp-size", str(dp_size)] if dp_size is not None else []),
        ]
        out.write(f"mxfp8-plugin check {' '.join(shown)}\n\n")
        out.write(report.format_table() + "\n")
    failed = [f.line() for f in report.errors + (report.warnings if fail_on_warning else [])]
    if fail_on_unchecked:
        failed += [f"unchecked {r.rule.id}: {r.note}" for r in report.results if r.status == "n/a"]
    first = (report.errors + (report.warnings if fail_on_warning else []))[:1]
    if failed and not as_json:
        where = credit(recipe, overrides or [], first[0]) if first else recipe
        err.write(f"{where}: {len(failed)} problem(s); first: {failed[0]}\n")
    return EXIT_ERRORS if failed else EXIT_OK


def credit(source: Any, overrides: Sequence[str], finding: Any) -> str:
    """Who wrote the value a finding is about: the command-line override that set its knob (the
    last one, as Hydra applies them in order), else the file, so the user edits the right place."""
    knobs = {k.strip() for k in str(finding.knob).split(",")}
    for text in reversed(list(overrides)):
        key = text.partition("=")[0].lstrip("+~")
        if key in knobs or any(k.startswith(key + ".") for k in knobs):
            return f"override {text!r}"
    return str(source)


def _fixed_class(key: str, provider: str | None = None) -> Any:
    """``(section, field, the section's fields)`` for a ``section.field`` key whose section is one
    known class: the ConfigContainer's, or for ``model`` the provider class ``--recipe`` names;
    None for a deeper key or an open section (its class is the base recipe's to decide)."""
    from ..probes.fields import section_fields, target_fields

    section, _, rest = key.partition(".")
    if not rest or "." in rest:
        return None
    known = target_fields(provider) if provider and section == "model" else section_fields(section)
    return (section, rest, known) if known.fixed and known.fields is not None else None


def _missing_deletion(deletions: list[str]) -> str | None:
    """A ``~section.key`` whose key no base recipe can hold: Hydra, as Bridge and the launcher
    call it, refuses it ("Could not delete from config"), so check must not pass it as "not
    checked". Judged only where the installed Bridge fixes the section to one class; deeper keys
    and open sections stay with the base recipe."""
    from ..probes.fields import container_sections

    sections = container_sections() if deletions else None
    for key in deletions:
        section = key.partition(".")[0]
        if sections is not None and section not in sections:
            return (
                f"override '~{key}': {section!r} is not a section of Bridge's ConfigContainer, "
                "so there is nothing to delete; drop the override"
            )
        fixed = _fixed_class(key)
        if fixed is None:
            continue
        _, rest, known = fixed
        if rest not in known.fields:
            return (
                f"override '~{key}': {known.owner} has no field {rest!r}, so Bridge's Hydra parse refuses "
                f"it (\"Could not delete from config. '{key}' does not exist.\"); drop the override"
            )
    return None


def missing_override(overrides: Sequence[str], base: Any) -> str | None:
    """A ``section.key=value`` (no ``+``) whose key the section's known class lacks: Hydra, as
    Bridge and the launcher call it, refuses to override it ("Key ... is not in struct"), so this is
    input that cannot be applied (exit 2), as for a deletion of a missing key."""
    for text in overrides:
        if text.startswith(("+", "~")) or "=" not in text:
            continue
        key = text.partition("=")[0]
        fixed = _fixed_class(key, getattr(base, "provider", None))
        if fixed is None or fixed[0] == "mxfp8_plugin":
            continue
        _, rest, known = fixed
        if rest not in known.fields:
            import difflib  # the error path only

            near = difflib.get_close_matches(rest, list(known.fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            return (
                f"override {text!r}: {known.owner} has no field {rest!r}{hint}, so Bridge's Hydra parse "
                f"refuses it (\"Could not override '{key}'. To append to your config use +{text}\")"
            )
    return None


def existing_addition(overrides: Sequence[str], base: Any) -> str | None:
    """A ``+section.key=value`` whose key the job's config already holds a value for: Hydra, as
    Bridge and the launcher call it, refuses to append it ("Could not append to config"; a key
    holding None it lets through). Judged where the section's class is known (fixed by the
    ConfigContainer, or the model provider ``--recipe`` names), the field's default is a literal
    other than None, and the base recipe's source does not assign it."""
    from ..probes.fields import MISSING

    for text in overrides:
        if not text.startswith("+") or text.startswith("++") or "=" not in text:
            continue
        key = text[1:].partition("=")[0]
        fixed = _fixed_class(key, getattr(base, "provider", None))
        if fixed is None or fixed[1] not in fixed[2].fields:
            continue
        section, rest, known = fixed
        field = dict.get(known.fields, rest) if isinstance(known.fields, dict) else None
        default = getattr(field, "default", MISSING)  # a LazyFields holds Field records
        assigned = section == "model" and rest in (getattr(base, "model", None) or {})
        if default is not MISSING and default is not None and not assigned:
            return (
                f"override {text!r}: {key} is already a field of {known.owner}, so Bridge's Hydra parse "
                f"refuses to add it (\"Could not append to config. An item is already at '{key}'\"); "
                f"drop the + ({text[1:]!r})"
            )
    return None


def _base_recipe(name: str | None) -> Any:
    """The ``--recipe`` function as its source tells it, None without one, or why it is not found."""
    if name is None:
        return None
    from ..probes._source import megatron_subdir
    from ..probes.recipe_source import find_recipe

    found = find_recipe(name)
    if found is not None:
        return found
    if ":" in name:
        module, _, func = name.rpartition(":")
        return (
            f"--recipe {name}: no function {func!r} found in {module!r} (looked for the file, on sys.path "
            "and under the working directory); give module:function or path/to/file.py:function"
        )
    if megatron_subdir("bridge", "__init__.py") is None:
        return (
            f"--recipe {name}: Megatron-Bridge is not installed here, so its recipes cannot be read; "
            "install megatron-bridge, or give your own recipe as module:function"
        )
    return (
        f"--recipe {name}: no recipe function of that name in the installed Megatron-Bridge "
        "(megatron/bridge/recipes); give its name, its dotted path, or your own as module:function"
    )


def _is_override(text: str) -> bool:
    try:
        _override(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def _json(payload: Any, indent: int | None = None) -> str:
    import json  # --json only: a plain check does not import it

    return json.dumps(payload, indent=indent)


def _emit_unreadable(message: str, as_json: bool, out: TextIO, err: TextIO) -> None:
    if as_json:
        out.write(_json({"ok": False, "unreadable": message}) + "\n")
    err.write(f"error: {message}\n")
