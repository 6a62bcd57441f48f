"""Hydra's ``key=value`` overrides applied as Bridge applies them, with one line per bad override.

Bridge's ``parse_hydra_overrides`` parses every override with Hydra's ``OverridesParser`` and
applies them with Hydra's ``_apply_overrides_to_config`` in struct mode. Here each override goes
alone (so an error names it), Hydra's multi-line messages become one line, and ``a.b.c=1``
where ``a.b`` is a value says so (Hydra's own message names neither). Private to :mod:`.read`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..options import PLUGIN_SECTION
from ._bounds import RecipeError, first_line

_ABSENT = object()


@functools.lru_cache(maxsize=1)
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse(text: str) -> Any:
    """Hydra's parse of one override (its ``Override``), or one line saying what is wrong."""
    try:
        (override,) = _parser().parse_overrides(overrides=[text])
    except Exception as exc:  # noqa: BLE001 - Hydra raises several types; all mean "bad syntax"
        detail = first_line(exc)
        if detail.startswith("LexerNoViableAltException"):  # Hydra's lexer names only the input
            detail = "not an override in Hydra's grammar (dotted.key=value, +key=value, ~key)"
        raise RecipeError(f"override {text!r}: {detail}") from None
    if not override.key_or_group:  # Hydra takes "=1" as the empty key: it would land as a section ""
        raise RecipeError(f"override {text!r}: no key; expected dotted.key=value, +key=value or ~key")
    return override


def _apply_error(text: str, exc: BaseException) -> RecipeError:
    # Bridge wraps Hydra's error (OverridesError); Hydra wraps OmegaConf's: name both inner ones.
    outer = exc.__cause__ if type(exc).__name__ == "OverridesError" and exc.__cause__ else exc
    cause = outer.__cause__
    detail = " ".join(line.strip() for line in str(outer).strip().splitlines()) or type(outer).__name__
    return RecipeError(f"override {text!r}: {detail}" + (f" ({first_line(cause)})" if cause else ""))


def _not_a_section(cfg: Any, text: str, key: str) -> None:
    """``a.b.c=1`` where ``a.b`` is a value: Hydra's own message names neither key nor value."""
    from omegaconf import DictConfig, OmegaConf

    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part) if isinstance(node, DictConfig) else None
        if nxt is None:
            return
        if not isinstance(nxt, DictConfig):
            where = ".".join(parts[: i + 1])
            value = nxt if isinstance(nxt, (str, int, float, bool)) else OmegaConf.to_container(nxt)
            raise RecipeError(
                f"override {text!r}: {where} is {value!r}, not a section, so it has no key {parts[i + 1]!r}"
            )
        node = nxt


def apply_loose(cfg: Any, overrides: Sequence[str], deletions: list[str] | None) -> None:
    """Hydra's parser and apply step, one override at a time (to name the bad one), on files
    alone: no struct mode, since only the base recipe knows which keys exist. A ``~key`` the
    files lack is recorded in ``deletions`` (it deletes from the base), or, with None, ignored."""
    if not overrides:
        return  # importing hydra costs ~0.3 s, most of check's budget
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf

    for text in overrides:
        override = parse(text)
        key = override.key_or_group
        _not_a_section(cfg, text, key)
        if override.is_delete() and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            if deletions is not None:
                deletions.append(key)
            continue
        try:
            ConfigLoaderImpl._apply_overrides_to_config(overrides=[override], cfg=cfg)
        except Exception as exc:  # noqa: BLE001 - ConfigCompositionException and OmegaConf's own
            raise _apply_error(text, exc) from None


def apply_plugin(cfg: Any, overrides: Sequence[str]) -> None:
    """``mxfp8_plugin.NAME=VALUE`` sets an option whether or not the file names it (every option
    has a default); ``~mxfp8_plugin.NAME`` of an unset option leaves its default."""
    from omegaconf import DictConfig, OmegaConf

    if not overrides:
        return
    created = PLUGIN_SECTION not in cfg
    if created:
        cfg[PLUGIN_SECTION] = {}
    if isinstance(cfg[PLUGIN_SECTION], DictConfig):
        OmegaConf.set_struct(cfg[PLUGIN_SECTION], False)
    apply_loose(cfg, overrides, None)
    if created and PLUGIN_SECTION in cfg and not cfg[PLUGIN_SECTION]:
        del cfg[PLUGIN_SECTION]  # only deletions: no section, as without the overrides


def apply_struct(cfg: Any, overrides: Sequence[str], bridge_parse: Callable[[Any, list[str]], Any]) -> Any:
    """Bridge's ``parse_hydra_overrides`` (struct mode: a key the recipe lacks needs ``+``), one
    override per call so an error names its override."""
    for text in overrides:
        _not_a_section(cfg, text, parse(text).key_or_group)  # our one-line syntax errors first
        try:
            cfg = bridge_parse(cfg, [text])
        except Exception as exc:  # noqa: BLE001 - OverridesError wrapping Hydra's and OmegaConf's
            raise _apply_error(text, exc) from None
    return cfg
