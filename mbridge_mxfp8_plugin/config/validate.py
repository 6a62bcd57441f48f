"""Config rules for MXFP8 param gather with grad-buffer reuse, checked before any GPU is touched.

The combination this plugin repairs (``fp8_param_gather`` + ``reuse_grad_buf_for_mxfp8_param_ag``
+ ``overlap_param_gather`` + distributed optimizer) is spread over three config sections that
Megatron-Bridge partly syncs, partly overwrites and partly ignores, and megatron-core checks only
one pair of it (with an ``assert``). Most wrong combinations therefore do not fail: they train,
on gradients read as weights or with a knob silently reset. :func:`validate_config` names every
such problem at once, with the knob path, the value seen and the YAML that fixes it.

This module runs the column's steps in order: ``view`` (what is written) -> ``effective``
(Bridge's precedence) -> ``rules`` -> ``report``; reading a recipe file is :mod:`.read`'s job.
The installed release pair comes from :mod:`..probes` (files only: no torch, no megatron-core).
The runtime side (live buckets, the adapters' train-start check) calls in here; nothing here
calls out to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..probes.stack import InstalledStack
from .effective import EffectiveConfig
from .report import ConfigValidationError, Finding, Rule, RuleResult, ValidationReport
from .rules import RULES, run_rules
from .view import read_config

__all__ = [
    "RULES",
    "ConfigValidationError",
    "Finding",
    "InstalledStack",
    "Rule",
    "RuleResult",
    "ValidationReport",
    "validate_config",
]


def validate_config(
    cfg: Any = None,
    *,
    ddp: Any = None,
    optimizer: Any = None,
    model: Any = None,
    plugin: Any = None,
    dp_size: int | None = None,
    strict: bool = True,
    installed: InstalledStack | None = None,
    skipped: Iterable[str] = (),
    base_recipe: Any = None,
) -> ValidationReport:
    """Run every rule; with ``strict`` raise :class:`ConfigValidationError` listing all errors.

    ``cfg`` is a recipe mapping (a loaded YAML, ``mxfp8_plugin:`` section included), a
    Megatron-Bridge ``ConfigContainer``, or megatron-core configs as a tuple
    ``(ddp_config, optimizer_config[, transformer_config])``; the same objects can be given as
    ``ddp=`` / ``optimizer=`` / ``model=`` instead. ``plugin`` (mapping or PluginOptions) describes
    how the plugin will be configured when ``cfg`` carries no ``mxfp8_plugin`` section.
    ``dp_size`` enables the padding rule; ``installed`` replaces the probe of the installed
    release pair (for tests, or to check a config for another cluster). ``skipped`` lists what
    the caller knows was not checked (e.g. :meth:`.read.RecipeInput.not_checked`).
    ``base_recipe`` (:class:`..probes.recipe_source.RecipeSource`) is the recipe a mapping is
    merged onto, as its source tells it: the model class and the model knobs it sets.
    """
    view = read_config(cfg, ddp=ddp, optimizer=optimizer, model=model, plugin=plugin, base_recipe=base_recipe)
    stack = installed if installed is not None else InstalledStack.detect()
    dp = dp_size if dp_size is not None else view.data_parallel_size
    results = run_rules(EffectiveConfig(view, dp, stack))
    report = ValidationReport(
        kind=view.kind,
        results=results,
        dp_size=dp,
        installed=stack.describe(),
        skipped=[*view.skipped, *skipped],
    )
    if strict and not report.ok:
        raise ConfigValidationError(report)
    return report
