"""The recipe YAMLs this project ships, found by name from a checkout and from an installed wheel.

The files live in the repository's top-level ``recipes/`` (where the README and Bridge users look
for them); the wheel build copies them to ``mbridge_mxfp8_plugin/recipes/`` (``setup.py``), so a
user outside a checkout can still say ``mxfp8-plugin check tiny_debug_mxfp8``. Leaf module: no
imports beyond the standard library, because ``check`` and the launcher call it before anything
heavy is loaded.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["recipe_path", "resolve_recipe", "shipped_recipes"]

_SUFFIX = ".yaml"


def _recipe_dirs() -> list[Path]:
    package = Path(__file__).resolve().parents[1]  # mbridge_mxfp8_plugin/
    # Installed wheel first; a checkout (editable install or PYTHONPATH) has only the top-level copy.
    return [d for d in (package / "recipes", package.parent / "recipes") if d.is_dir()]


def shipped_recipes() -> list[str]:
    """Names of the shipped recipes (file stems), sorted."""
    return sorted({p.stem for d in _recipe_dirs() for p in d.glob(f"*{_SUFFIX}")})


def recipe_path(name: str) -> Path:
    """The shipped recipe ``name`` (``"tiny_debug_mxfp8"`` or ``"tiny_debug_mxfp8.yaml"``).

    Raises ``FileNotFoundError`` naming the recipes that do exist, so a typo reads as one line.
    """
    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    if stem and "/" not in stem and "\\" not in stem:
        for d in _recipe_dirs():
            candidate = d / f"{stem}{_SUFFIX}"
            if candidate.is_file():
                return candidate
    known = ", ".join(shipped_recipes()) or "none found (incomplete install?)"
    raise FileNotFoundError(f"no shipped recipe named {name!r}; shipped recipes: {known}")


def resolve_recipe(path_or_name: str | Path) -> Path:
    """An existing file as given; otherwise the shipped recipe of that name, if there is one.

    A path that is neither comes back unchanged, so the caller's own "cannot read FILE" message
    names what the user typed.
    """
    path = Path(path_or_name)
    if path.exists():
        return path
    try:
        return recipe_path(str(path_or_name))
    except FileNotFoundError:
        return path
