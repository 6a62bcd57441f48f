"""Public import path of the recipe helpers (``from mbridge_mxfp8_plugin.recipes import apply_recipe``).

They live in :mod:`mbridge_mxfp8_plugin.adapters.recipes`; the shipped YAMLs' comments and users'
scripts name this path.
"""

from .adapters.recipes import apply_recipe, callbacks_from_recipe

__all__ = ["apply_recipe", "callbacks_from_recipe"]
