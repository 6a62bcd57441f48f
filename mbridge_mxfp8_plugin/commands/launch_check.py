"""``check``'s rules on the launcher's inputs, before and after the recipe function built its job.

The launcher judges the file and overrides with ``check``'s rules twice: in a second, before
Bridge is imported (what only the recipe decides is left unchecked), and once the container
exists, with the facts ``check --recipe`` reads from source read off that container instead (its
model class, its ``comm_overlap``, its model knobs). ``check`` and the launcher are one judge: an
error here exits 1, as ``check`` exits on the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config.read import RecipeInput
from ..errors import MXFP8ConfigError
from ..options import PluginOptions
from .check import credit

__all__ = ["CheckRefused", "check_inputs", "container_facts"]


class CheckRefused(MXFP8ConfigError):
    """``check``'s error on the launcher's inputs (a key or a value it knows to be wrong, or, under
    ``strict``, any rule error): exit 1, as ``check`` exits on the same inputs, not 2."""


def _base_recipe(name: str) -> Any:
    """The recipe function's source facts for ``check``'s input rules (read, not imported), or
    None where the recipe is the user's own or its source says nothing."""
    from ..probes.recipe_source import find_recipe

    try:
        return find_recipe(name.replace(":", "."))
    except Exception:  # noqa: BLE001 - a reader of upstream source: no verdict is "not known"
        return None


def container_facts(config: Any, recipe_name: str) -> Any:
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


def check_inputs(
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
