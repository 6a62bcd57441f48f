"""The plugin's options: one dataclass behind every entry point.

``MXFP8ParamSyncCallback(...)``, ``MXFP8ParamSyncLightningCallback(...)``, a recipe's
``mxfp8_plugin:`` section and ``check``'s schema all read :class:`PluginOptions`, so an option
added here exists everywhere at once, with the same default and the same help text. Nothing in
this module imports torch or a training framework: ``check`` reads it on a login node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PLUGIN_SECTION", "PluginOptions", "option_doc", "option_types"]

#: The plugin's own section in a recipe YAML; split off before Bridge sees the rest.
PLUGIN_SECTION = "mxfp8_plugin"


def _opt(default: Any, doc: str, *, scope: str = "all") -> Any:
    return field(default=default, metadata={"doc": doc, "scope": scope})


@dataclass(frozen=True)
class PluginOptions:
    """How the plugin runs. Defaults are the safe choice on every release pair."""

    #: Register the callback at all (a recipe can switch the plugin off; check's MX009 says
    #: whether the installed release then trains on stale or polluted weights).
    enabled: bool = _opt(True, "register the plugin's callback at all")
    #: Raise on config-rule errors at train start instead of logging them.
    strict: bool = _opt(True, "refuse to start when validation finds an error (false: log and go on)")
    #: Check the config (Bridge ConfigContainer, else the live megatron-core configs) at train start.
    validate: bool = _opt(True, "check the job's config at train start")
    #: Rewrite bucket offsets that ignore the 64-element padding (defect A); False raises instead.
    repair_alignment: bool = _opt(True, "rewrite wrong bucket offsets (defect A) at train start")
    #: Stage main params ahead of a forced sync the loop is about to issue, so that the
    #: framework's own all-gather collects weights (False: gather again at eval start).
    prestage: bool = _opt(True, "stage main params before a forced sync the loop is about to issue")
    #: Vote each step on SIGTERM / time-limit exit saves (Bridge's exit_signal_handler,
    #: exit_duration_in_mins) and prepare the weights for them.
    guard_exit_saves: bool = _opt(
        True, "prepare the weights for SIGTERM / time-limit exit saves (Bridge)", scope="bridge"
    )
    #: Make the weights current after the training loop, for export or test after train().
    refresh_at_train_end: bool = _opt(True, "make the weights current after the training loop")
    #: Stage main params at NeMo's on_megatron_microbatches_start (Lightning/NeMo 2 only).
    stage_for_nemo_steps: bool = _opt(
        True, "stage main params at NeMo's microbatch start (Lightning)", scope="lightning"
    )
    #: Data-parallel size the job runs with; only for check's padding rule (MX008).
    dp_size: int | None = _opt(None, "data-parallel size the job will run with, for the padding check")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> PluginOptions:
        """Strict: an unknown option or a wrongly typed value is an error, not a silent default."""
        from .config.schema import suggest, type_problem
        from .errors import MXFP8ConfigError

        data = dict(data or {})
        types = option_types()
        problems = []
        for key, value in data.items():
            if key not in types:
                problems.append(f"{PLUGIN_SECTION}.{key} is not a plugin option{suggest(str(key), types)}")
                continue
            expected = type_problem(value, types[key])
            if expected:
                problems.append(f"{PLUGIN_SECTION}.{key} must be {expected}, got {value!r}")
        if problems:
            raise MXFP8ConfigError("; ".join(problems))
        return cls(**data)

    def replace(self, **changes: Any) -> PluginOptions:
        """These options with the given ones changed; ``None`` values mean "keep"."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def option_types() -> dict[str, Any]:
    """Option name -> type, for the ``mxfp8_plugin:`` section's schema."""
    hints = {"bool": bool, "int | None": int | None}
    return {f.name: hints[str(f.type)] for f in dataclasses.fields(PluginOptions)}


def option_doc(name: str) -> str:
    """The one-line help of an option (the same text everywhere it is shown)."""
    for f in dataclasses.fields(PluginOptions):
        if f.name == name:
            return str(f.metadata["doc"])
    raise KeyError(name)
