"""The one reader: recipe files, ``key=value`` overrides and the ``mxfp8_plugin`` section, as
Megatron-Bridge reads them.

Bridge's ``--config-file`` path (``training/utils/omegaconf_utils.py``, 0.3 to 0.6) is: the recipe
function's ``ConfigContainer`` as an OmegaConf dict (``create_omegaconf_dict_config``), then
``OmegaConf.merge`` of the file, Hydra's ``OverridesParser`` + ``_apply_overrides_to_config`` in
struct mode (``parse_hydra_overrides``), ``OmegaConf.to_container(resolve=True)`` and
``apply_overrides`` back onto the dataclasses. :func:`merge_onto_container` is that path, calling
Bridge's own functions; :func:`compose` is the same steps without the container, for ``check``
and :mod:`..recipes`, which have only the files. Every entry point (``check``, ``load_recipe``,
``apply_recipe``, the launcher) reads through here, so ``lr: 1e-4`` is the float 0.0001 to all of
them as to Bridge, a duplicate key is refused, a quoted ``'true'`` stays a string.

Two additions to Bridge's path. The ``mxfp8_plugin`` section is the plugin's, never Bridge's
(Bridge would skip it with a warning its own log filter hides): ``mxfp8_plugin.*`` overrides
set options whether or not the file names them (an option has a default, so it always
"exists"), and :func:`plugin_section` splits the section off. Without the base recipe (a
Python function ``check`` does not run) an interpolation into it, and ``???`` (which keeps the
base's value when merged), are kept as :class:`BaseRef` ("not checked"), never guessed; a
``~key`` the files lack deletes from the base and is recorded. Hostile input is bounded first
(:mod:`._bounds`).
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ..common.records import record
from ..options import PLUGIN_SECTION
from ._bounds import (
    MAX_BYTES,
    MAX_NODES,
    RecipeError,
    bound_interpolations,
    fail,
    first_line,
    prescan,
    read_text,
    yaml_error,
)
from ._overrides import apply_loose, apply_plugin, apply_struct

__all__ = [
    "MAX_BYTES",
    "MAX_NODES",
    "BaseRef",
    "RecipeError",
    "RecipeInput",
    "compose",
    "merge_onto_container",
    "plugin_section",
    "read_recipe_file",
    "split_bridge_argv",
    "split_overrides",
]

#: OmegaConf's mandatory-value marker.
MISSING = "???"
#: Bridge's scripts spell the file flag both ways (run_recipe.py: --config-file; examples: --config_file).
FILE_FLAGS = ("--config-file", "--config_file")


@record
class BaseRef:
    """A value only the base recipe (which ``check`` does not have) decides: an interpolation
    into it, or ``???``, which merged onto it keeps the base's value."""

    expr: str

    def __repr__(self) -> str:
        return self.expr


@record(frozen=False)
class RecipeInput:
    """The recipe as Bridge would merge it: plain containers, interpolations resolved, the
    ``mxfp8_plugin`` section still in ``data`` (``check`` judges it with the rest)."""

    path: str
    data: dict[str, Any]
    #: dotted key -> interpolation into the base recipe, or ``???`` (decided by the base recipe)
    base_refs: dict[str, str] = field(default_factory=dict)
    #: ``~key`` overrides of keys the files do not have (they delete from the base recipe)
    base_deletions: list[str] = field(default_factory=list)

    def not_checked(self) -> list[str]:
        """What the base recipe decides, for the report's "not checked" lines."""
        lines = [
            f"{key} = {expr}: "
            + (
                "keeps the base recipe's value (or give it on the command line)"
                if expr == MISSING
                else "an interpolation into the base recipe (not in this file)"
            )
            for key, expr in self.base_refs.items()
        ]
        return lines + [
            f"~{key}: deletes a key of the base recipe (not in this file)" for key in self.base_deletions
        ]

    def require_resolved(self, prefix: str = "", *, fix: str) -> None:
        """Refuse a value only the base recipe decides (under ``prefix``), where the caller must
        apply the result itself and cannot leave it "not checked"."""
        refs = [k for k in self.base_refs if k.startswith(prefix)]
        if refs:
            raise RecipeError(
                f"{self.path}: {refs[0]} is {self.base_refs[refs[0]]}, which only the base recipe "
                f"decides; {fix}"
            )


# --------------------------------------------------------------------------- arguments
def split_bridge_argv(argv: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(config_files, overrides)`` of a Bridge script's arguments (``--config-file FILE`` then
    ``key=value`` Hydra overrides, as its recipe scripts take ``sys.argv[1:]``).

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
        if flag in FILE_FLAGS:
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


def _is_plugin_key(text: str) -> bool:
    key = text.split("=", 1)[0].lstrip("+~")
    return key == PLUGIN_SECTION or key.startswith(PLUGIN_SECTION + ".")


def split_overrides(overrides: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(bridge_overrides, plugin_overrides)``: those under ``mxfp8_plugin`` never reach Bridge."""
    bridge: list[str] = []
    plugin: list[str] = []
    for text in overrides:
        (plugin if _is_plugin_key(text) else bridge).append(text)
    return bridge, plugin


def plugin_section(
    data: Mapping[str, Any], source: str | Path
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(everything else, the mxfp8_plugin section or None)``; the section must be a mapping.

    The one place that says so for the entry points that apply a recipe (``check`` reports the
    same as a finding, next to the file's other problems).
    """
    rest = {str(k): v for k, v in data.items() if k != PLUGIN_SECTION}
    section = data.get(PLUGIN_SECTION)
    if section is not None and not isinstance(section, Mapping):
        raise RecipeError(f"{source}: {PLUGIN_SECTION} must be a mapping of plugin options, got {section!r}")
    return rest, (dict(section) if section is not None else None)


# --------------------------------------------------------------------------- files
def _require_readers(source: str, overrides: bool) -> None:
    """OmegaConf and Hydra are Bridge's readers; hydra costs ~0.3 s to import, so only when
    there are overrides (Bridge parses them only then too)."""
    for module in ("omegaconf", "hydra.core.override_parser.overrides_parser")[: 2 if overrides else 1]:
        try:
            importlib.import_module(module)
        except ImportError:
            raise RecipeError(
                f"{source}: reading a recipe needs omegaconf and hydra-core, Megatron-Bridge's own readers "
                f"({module.split('.')[0]} is not importable): "
                "pip install 'omegaconf>=2.3,<2.4' 'hydra-core>=1.3,<1.4'"
            ) from None


def load_file(path: Path) -> Any:
    """``OmegaConf.load`` of one recipe file, bounded, refusing what is not a mapping of sections."""
    import yaml
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    text = read_text(path)
    prescan(path, text)
    try:
        cfg = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    except (OmegaConfBaseException, OSError, ValueError, TypeError) as exc:
        msg = first_line(exc)
        if "Invalid loaded object type" in msg:
            kind = msg.rsplit(":", 1)[-1].strip()
            raise fail(
                path, f"the recipe is a {kind}; expected a mapping of ConfigContainer sections"
            ) from None
        raise fail(path, f"OmegaConf cannot load it: {msg}") from None
    if isinstance(cfg, ListConfig):
        raise fail(
            path,
            "the recipe is a list; expected a mapping of ConfigContainer sections (ddp:, optimizer:, ...)",
        )
    if not isinstance(cfg, DictConfig) or len(cfg) == 0:
        raise fail(path, "the recipe is empty; expected a mapping of ConfigContainer sections")
    bad = [k for k in cfg.keys() if not isinstance(k, str)]
    if bad:
        raise fail(path, f"top-level keys must be section names, got {bad[0]!r}")
    return cfg


# --------------------------------------------------------------------------- resolving
def _resolve(source: str, node: Any, prefix: str, refs: dict[str, str]) -> Any:
    """A plain container of ``node`` with every interpolation resolved, or a :class:`BaseRef`."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import (
        InterpolationKeyError,
        InterpolationToMissingValueError,
        OmegaConfBaseException,
    )

    keys: list[Any] = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    out: Any = {} if isinstance(node, DictConfig) else []
    for key in keys:
        dotted = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            # OmegaConf's "mandatory" value: merged onto the base recipe it keeps the base's value
            # (Bridge's own examples use it for "give this on the command line").
            refs[dotted] = MISSING
            value: Any = BaseRef(MISSING)
        elif OmegaConf.is_interpolation(node, key):
            expr = str(node._get_node(key)._value())
            try:
                value = node[key]
            except (InterpolationKeyError, InterpolationToMissingValueError):
                refs[dotted] = expr
                value = BaseRef(expr)
            except OmegaConfBaseException as exc:
                raise fail(source, f"{dotted}: cannot resolve {expr}: {first_line(exc)}") from None
        else:
            value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            value = _resolve(source, value, dotted + ".", refs)
        if isinstance(out, dict):
            out[key] = value
        else:
            out.append(value)
    return out


def compose(
    files: Sequence[str | Path],
    overrides: Iterable[str] = (),
    *,
    base: Any = None,
    parse_overrides: Callable[[Any, list[str]], Any] | None = None,
) -> RecipeInput:
    """``files`` merged in order (onto ``base``, an OmegaConf dict of the recipe, when there is
    one), then ``overrides``, then resolved; raises :class:`RecipeError` with one line.

    With ``base`` the overrides apply in struct mode through ``parse_overrides`` (Bridge's
    ``parse_hydra_overrides``), and everything resolves. Without it, values only the
    base decides come back as :class:`BaseRef` and ``~key`` of a missing key is recorded.
    """
    overrides = list(overrides)
    source = str(files[0]) if files else "overrides"
    _require_readers(source, bool(overrides))
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = base
    for path in map(Path, files):
        loaded = load_file(path)
        try:
            cfg = loaded if cfg is None else OmegaConf.merge(cfg, loaded)
        except OmegaConfBaseException as exc:
            raise fail(path, f"cannot be merged onto the recipe: {first_line(exc)}") from None
    if cfg is None:
        cfg = OmegaConf.create({})
    bridge_overrides, plugin_overrides = split_overrides(overrides)
    apply_plugin(cfg, plugin_overrides)  # before struct mode: the section is ours, not the recipe's
    deletions: list[str] = []
    if base is None:
        apply_loose(cfg, bridge_overrides, deletions)
    elif bridge_overrides:
        if parse_overrides is None:
            raise TypeError("compose(base=...) applies overrides with Bridge's parse_hydra_overrides")
        cfg = apply_struct(cfg, bridge_overrides, parse_overrides)
    bound_interpolations(source, cfg)
    refs: dict[str, str] = {}
    if base is None:
        data = _resolve(source, cfg, "", refs)
    else:
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as exc:
            raise fail(source, f"cannot resolve {first_line(exc)}") from None
    return RecipeInput(source, {str(k): v for k, v in data.items()}, refs, deletions)


def read_recipe_file(path: str | Path, overrides: Iterable[str] = ()) -> RecipeInput:
    """One file with overrides, without its base recipe (``check``'s view); raises :class:`RecipeError`."""
    return compose([path], overrides)


# --------------------------------------------------------------------------- onto a ConfigContainer
def _bridge_omegaconf_utils() -> Any:
    try:
        from megatron.bridge.training.utils import omegaconf_utils  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RecipeError(
            "merging a recipe onto a ConfigContainer uses Megatron-Bridge's own omegaconf_utils, which "
            f"cannot be imported ({exc.name or 'megatron.bridge'}: {first_line(exc)})"
        ) from None
    return omegaconf_utils


def unappliable(obj: Any, data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """What Bridge's ``apply_overrides`` would skip with a WARNING its own log filter hides, or
    set to something the job cannot use: unknown keys, a mapping onto a recipe name, a dtype name
    the installed Bridge does not convert (it would keep the string)."""
    from ..probes.bridge_facts import dtype_name_problem

    out = []
    names = sorted(f.name for f in fields(obj)) if is_dataclass(obj) else []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key.startswith("_") and key.endswith("_"):  # _target_, _call_, ...: Bridge's instantiation
            continue
        if not hasattr(obj, key):
            import difflib  # the error path only

            close = difflib.get_close_matches(key, names, n=1)
            out.append(
                f"{path} is not a field of {type(obj).__name__}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
            continue
        current = getattr(obj, key)
        if isinstance(value, Mapping) and "_target_" in value:
            continue
        if is_dataclass(current) and isinstance(value, Mapping):
            out += unappliable(current, value, f"{path}.")
        elif isinstance(current, str) and isinstance(value, Mapping):
            out.append(
                f"{path} is {current!r} in the recipe (a name, not a section), so the mapping "
                f"{dict(value)!r} cannot be merged into it; give a name instead, e.g. "
                f"{key}: bf16_with_mxfp8_mixed"
            )
        elif type(current).__name__ == "dtype" and isinstance(value, str) and dtype_name_problem(value):
            out.append(f"{path}={value!r}: expected {dtype_name_problem(value)}")
    return out


def merge_onto_container(
    container: Any, files: Sequence[str | Path], overrides: Iterable[str] = ()
) -> RecipeInput:
    """Bridge's ``process_config_with_overrides`` with Bridge's own functions, step by step, the
    ``mxfp8_plugin`` section kept out of the container, and what Bridge would silently skip
    refused (:func:`unappliable`) before anything is set. Returns what was merged (plugin
    section included, for the caller to validate)."""
    ou = _bridge_omegaconf_utils()
    omega, excluded = ou.create_omegaconf_dict_config(container)
    recipe = compose(files, overrides, base=omega, parse_overrides=ou.parse_hydra_overrides)
    data, _ = plugin_section(recipe.data, recipe.path)
    problems = unappliable(container, data)
    if problems:
        raise RecipeError(f"{recipe.path}: {'; '.join(problems)}")
    ou.apply_overrides(container, data, excluded)
    return recipe
