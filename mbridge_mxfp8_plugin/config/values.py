"""What the reader hands the rules: each knob's value and where it was written, and the problems
found in the input itself.

A value the config does not decide (it comes from a base recipe ``check`` cannot see) is
:data:`UNKNOWN`, never a guessed default, so a rule can say "not checked" instead of "pass".
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

from ..common.records import record

__all__ = ["UNKNOWN", "ConfigView", "InputIssue", "IssueKind", "Kind", "Val"]

Kind = Literal["recipe", "bridge", "mcore"]
#: What is wrong with the input itself; the rules (:mod:`.rules.inputs`) give each kind its id.
IssueKind = Literal["unknown_key", "wrong_type", "unknown_recipe"]


class _Unknown:
    """A value the config does not determine (it comes from a base recipe we cannot see)."""

    def __repr__(self) -> str:
        return "<not set>"

    def __bool__(self) -> bool:
        raise TypeError("UNKNOWN has no truth value; test `is UNKNOWN` first")


UNKNOWN: Any = _Unknown()


@record
class Val:
    """A knob's value and the dotted path it was read from (what messages point the user at)."""

    value: Any
    path: str

    @property
    def known(self) -> bool:
        return self.value is not UNKNOWN


@record
class InputIssue:
    """A problem with the input itself: unknown key, wrong type, unknown recipe name.

    ``severity`` is "warning" for a key that is not a field of the classes ``check`` could see
    while the class the job builds is not known (a subclass may have it): unknown, not wrong.
    """

    kind: IssueKind
    knob: str
    value: Any
    message: str
    fix: Any = None
    severity: Literal["error", "warning"] = "error"


@record(frozen=False)
class ConfigView:
    """One config as the rules read it, whichever form it came in (a recipe file, Bridge's
    ConfigContainer, megatron-core's own config objects)."""

    kind: Kind
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``mixed_precision`` as written: a recipe name, the field values, or absent/None.
    mp_name: str | None = None
    mp_values: dict[str, Any] | None = None
    #: ``mixed_precision`` appears in the input (even as null, which replaces the base recipe's).
    mp_stated: bool = False
    plugin: dict[str, Any] = field(default_factory=dict)
    plugin_stated: bool = False
    data_parallel_size: int | None = None
    issues: list[InputIssue] = field(default_factory=list)
    #: dotted key -> interpolation into the base recipe (its value is unknown here)
    base_refs: dict[str, str] = field(default_factory=dict)
    #: section -> the ``_target_`` Bridge instantiates it from
    targets: dict[str, str] = field(default_factory=dict)
    #: checks that could not run, and why (shown under the report)
    skipped: list[str] = field(default_factory=list)
    #: sections of the file whose keys could not be checked (MX101 must not vouch for them)
    unchecked_sections: list[str] = field(default_factory=list)
    #: the mixed-precision registry was read from the installed Bridge (MX103 may vouch for names)
    recipe_names_checked: bool = False
    #: what the named base recipe (``check --recipe``) sets, as far as its source says
    base_recipe: Any = None

    @property
    def invalid_paths(self) -> set[str]:
        """Knobs that were written but rejected (wrong type, unknown): not "unset"."""
        return {i.knob for i in self.issues if i.severity == "error"}

    @property
    def mp_present(self) -> bool:
        return self.mp_values is not None

    def raw(self, section: str, knob: str) -> Val:
        """The value written in ``section`` (UNKNOWN if not written / not readable)."""
        return Val(self.sections.get(section, {}).get(knob, UNKNOWN), f"{section}.{knob}")

    def mp(self, knob: str) -> Val:
        if self.mp_values is None:
            return Val(UNKNOWN, f"mixed_precision.{knob}")
        path = f"mixed_precision={self.mp_name}" if self.mp_name else f"mixed_precision.{knob}"
        return Val(self.mp_values.get(knob, UNKNOWN), path)
