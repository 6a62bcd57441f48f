"""Read a recipe YAML and its command-line overrides exactly as Megatron-Bridge does.

Bridge's ``--config-file`` path (``training/utils/omegaconf_utils.py``, 0.3 to 0.6) is:
``OmegaConf.load(file)``, ``OmegaConf.merge(base, file)``, Hydra's ``OverridesParser`` for
``key=value`` / ``+key=value`` / ``~key``, applied by Hydra's own ``_apply_overrides_to_config``,
then ``OmegaConf.to_container(resolve=True)``. We call the same functions, so ``lr: 1e-4`` is the
float 0.0001 here as it is there, a duplicate key is refused here as it is there, and a quoted
``'true'`` stays a string. The one thing ``check`` lacks is the base recipe (a Python function):
an interpolation into it, and ``???`` (which keeps the base's value when merged), are kept as
:class:`BaseRef` ("not checked"), never guessed.

Hostile input is bounded *before* OmegaConf sees it (OmegaConf copies every alias into its own
node tree, so a 1 kB anchor bomb becomes gigabytes): a size cap, strict UTF-8, and a scan of the
YAML event stream that counts the nodes aliases would expand to. Interpolation chains that fan
out are bounded the same way before anything is resolved.
"""

from __future__ import annotations

import importlib
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MXFP8ConfigError

__all__ = ["MAX_BYTES", "MAX_NODES", "BaseRef", "RecipeError", "RecipeInput", "read_recipe_file"]

#: Largest recipe file read (Bridge's own example overrides are < 4 kB).
MAX_BYTES = 1 << 20
#: Most YAML nodes a recipe may expand to once aliases are copied (the bound on anchor bombs).
MAX_NODES = 200_000
#: Most values one interpolation may reach through other interpolations.
MAX_INTERPOLATION_FANOUT = 10_000


#: OmegaConf's mandatory-value marker.
MISSING = "???"


class RecipeError(MXFP8ConfigError):
    """The recipe could not be read at all: one line naming the file and the cause."""


@dataclass(frozen=True)
class BaseRef:
    """A value only the base recipe (which ``check`` does not have) decides: an interpolation
    into it, or ``???``, which merged onto it keeps the base's value."""

    expr: str

    def __repr__(self) -> str:
        return self.expr


@dataclass
class RecipeInput:
    """The recipe as Bridge would merge it: plain containers, interpolations resolved."""

    path: str
    data: dict[str, Any]
    #: dotted key -> interpolation into the base recipe, or ``???`` (decided by the base recipe)
    base_refs: dict[str, str] = field(default_factory=dict)
    #: ``~key`` overrides of keys this file does not have (they delete from the base recipe)
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


def _fail(path: Path, cause: str) -> RecipeError:
    return RecipeError(f"{path}: {cause}")


def _read_text(path: Path) -> str:
    if not path.exists():
        raise _fail(path, "no such recipe file")
    if path.is_dir():
        raise _fail(path, "is a directory; give a recipe YAML file")
    if not path.is_file():
        raise _fail(path, "is not a regular file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise _fail(path, f"is {size} bytes; check reads recipes of at most {MAX_BYTES} bytes")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _fail(path, f"cannot read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(path, f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def _yaml_error(path: Path, exc: Exception) -> RecipeError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    context = getattr(exc, "context", None)
    if problem and "duplicate key" in str(exc):
        problem = f"{problem} ({context})" if context else problem
    return _fail(path, f"invalid YAML{where}: {problem}")


def _prescan(path: Path, text: str) -> None:
    """Count the nodes the document expands to, aliases included, from the event stream alone."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    anchors: dict[str, int] = {}
    stack: list[list[Any]] = [[None, 0]]  # [anchor, nodes] per open collection; root first
    docs = 0
    try:
        for event in yaml.parse(io.StringIO(text), Loader=loader):
            if isinstance(event, yaml.DocumentStartEvent):
                docs += 1
                if docs > 1:
                    raise _fail(path, "holds several YAML documents; a recipe is one mapping")
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([event.anchor, 1])
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, count = stack.pop()
                if anchor:
                    anchors[anchor] = count
                stack[-1][1] += count
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor:
                    anchors[event.anchor] = 1
                stack[-1][1] += 1
            elif isinstance(event, yaml.AliasEvent):
                stack[-1][1] += anchors.get(event.anchor or "", 1)
            if stack[0][1] > MAX_NODES or (len(stack) > 1 and stack[-1][1] > MAX_NODES):
                raise _fail(
                    path,
                    f"its anchors and aliases expand to more than {MAX_NODES} values (a YAML "
                    "'billion laughs' bomb?); refusing to load it",
                )
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None


def _load(path: Path, text: str) -> Any:
    import yaml
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _prescan(path, text)
    try:
        cfg = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    except (OmegaConfBaseException, OSError, ValueError, TypeError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Invalid loaded object type" in msg:
            kind = msg.rsplit(":", 1)[-1].strip()
            raise _fail(
                path, f"the recipe is a {kind}; expected a mapping of ConfigContainer sections"
            ) from None
        raise _fail(path, f"OmegaConf cannot load it: {msg}") from None
    if isinstance(cfg, ListConfig):
        raise _fail(
            path,
            "the recipe is a list; expected a mapping of ConfigContainer sections (ddp:, optimizer:, ...)",
        )
    if not isinstance(cfg, DictConfig) or len(cfg) == 0:
        raise _fail(path, "the recipe is empty; expected a mapping of ConfigContainer sections")
    bad = [k for k in cfg.keys() if not isinstance(k, str)]
    if bad:
        raise _fail(path, f"top-level keys must be section names, got {bad[0]!r}")
    return cfg


_ABSENT = object()


def _apply_overrides(path: Path, cfg: Any, overrides: list[str], deletions: list[str]) -> None:
    """Hydra's parser and Hydra's own apply step, one override at a time (to name the bad one).

    Bridge applies them in struct mode onto the *merged* config; we have only the file, so a
    ``~key`` for a key the file lacks deletes from the base recipe: recorded, not an error.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import DictConfig, OmegaConf

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides(overrides=[text])
        except Exception as exc:  # noqa: BLE001 - Hydra raises several types; all mean "bad syntax"
            raise RecipeError(f"override {text!r}: {_first_line(exc)}") from None
        key = override.key_or_group
        parts = key.split(".")
        node: Any = cfg
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part) if isinstance(node, DictConfig) else None
            if nxt is None:
                break
            if not isinstance(nxt, DictConfig):
                where = ".".join(parts[: i + 1])
                value = OmegaConf.to_container(nxt) if not isinstance(nxt, (str, int, float, bool)) else nxt
                raise RecipeError(
                    f"override {text!r}: {where} is {value!r}, not a section, "
                    f"so it has no key {parts[i + 1]!r}"
                )
            node = nxt
        if override.is_delete() and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            deletions.append(key)
            continue
        try:
            ConfigLoaderImpl._apply_overrides_to_config(overrides=[override], cfg=cfg)
        except Exception as exc:  # noqa: BLE001 - ConfigCompositionException and OmegaConf's own
            cause = exc.__cause__ or exc
            raise RecipeError(f"override {text!r}: {_first_line(exc)} ({_first_line(cause)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_REF = re.compile(r"\$\{([^${}:]+)\}")


def _bound_interpolations(path: Path, cfg: Any) -> None:
    """Refuse interpolation chains that fan out (``a: ${b}${b}``, ``b: ${c}${c}``, ...) before
    OmegaConf resolves them: each level doubles the work, so 40 lines would never finish."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=False)
    strings: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            dotted = f"{prefix}{k}"
            if isinstance(v, str) and "${" in v:
                strings[dotted] = v
            walk(v, dotted + ".")

    walk(container, "")
    memo: dict[str, int] = {}

    def reach(key: str, depth: int) -> int:
        if key in memo:
            return memo[key]
        if depth > 100:
            raise _fail(path, f"interpolations nest more than 100 deep at {key}")
        memo[key] = 1  # a cycle counts once; OmegaConf reports it when resolving
        total = 1 + sum(reach(ref.strip(), depth + 1) for ref in _REF.findall(strings.get(key, "")))
        memo[key] = total
        if total > MAX_INTERPOLATION_FANOUT:
            raise _fail(path, f"{key} expands through more than {MAX_INTERPOLATION_FANOUT} interpolations")
        return total

    for key in strings:
        reach(key, 0)


def _resolve(path: Path, node: Any, prefix: str, refs: dict[str, str]) -> Any:
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
                raise _fail(path, f"{dotted}: cannot resolve {expr}: {_first_line(exc)}") from None
            if isinstance(value, (DictConfig, ListConfig)):
                value = _resolve(path, value, dotted + ".", refs)
        else:
            value = node[key]
            if isinstance(value, (DictConfig, ListConfig)):
                value = _resolve(path, value, dotted + ".", refs)
        if isinstance(out, dict):
            out[key] = value
        else:
            out.append(value)
    return out


def read_recipe_file(path: str | Path, overrides: Iterable[str] = ()) -> RecipeInput:
    """The recipe with overrides applied and interpolations resolved; raises :class:`RecipeError`."""
    p = Path(path)
    text = _read_text(p)
    overrides = list(overrides)
    # hydra costs ~0.3 s to import: only when there are overrides (Bridge parses them only then too).
    for module in ("omegaconf", "hydra.core.override_parser.overrides_parser")[: 2 if overrides else 1]:
        try:
            importlib.import_module(module)
        except ImportError:
            raise RecipeError(
                f"{p}: reading a recipe needs omegaconf and hydra-core, Megatron-Bridge's own readers "
                f"({module.split('.')[0]} is not importable): "
                "pip install 'omegaconf>=2.3,<2.4' 'hydra-core>=1.3,<1.4'"
            ) from None
    cfg = _load(p, text)
    deletions: list[str] = []
    if overrides:
        _apply_overrides(p, cfg, overrides, deletions)
    _bound_interpolations(p, cfg)
    refs: dict[str, str] = {}
    data = _resolve(p, cfg, "", refs)
    return RecipeInput(str(p), data, refs, deletions)
