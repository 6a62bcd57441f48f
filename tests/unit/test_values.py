"""The records the config reader hands the rules (config/values.py): a knob's value and the path
it was read from, and ``UNKNOWN`` for what the file does not decide.

A value the config leaves to a base recipe ``check`` cannot see must never read as a default: a
rule has to say "not checked", so ``UNKNOWN`` refuses a truth value, and ``known`` tells a written
``null``/``false`` (decided) from ``UNKNOWN`` (not decided). Every lookup names the dotted path a
message points the user at, whether or not the knob was written.
"""

from __future__ import annotations

import dataclasses

import pytest

from mbridge_mxfp8_plugin.config.values import UNKNOWN, ConfigView, InputIssue, Val


def test_unknown_has_no_truth_value_and_says_not_set() -> None:
    with pytest.raises(TypeError, match="is UNKNOWN"):
        bool(UNKNOWN)
    with pytest.raises(TypeError):
        if UNKNOWN:  # the mistake the refusal exists for: reading "not set" as False
            pass
    assert repr(UNKNOWN) == "<not set>"


@pytest.mark.parametrize("written", [None, False, 0, ""], ids=["null", "false", "zero", "empty"])
def test_a_written_falsy_value_is_known(written: object) -> None:
    assert Val(written, "ddp.overlap_param_gather").known
    assert not Val(UNKNOWN, "ddp.overlap_param_gather").known


def test_raw_reads_the_written_value_and_names_its_path() -> None:
    view = ConfigView("bridge", sections={"ddp": {"overlap_param_gather": False}})
    assert view.raw("ddp", "overlap_param_gather") == Val(False, "ddp.overlap_param_gather")
    unset = view.raw("ddp", "bucket_size")
    assert unset.value is UNKNOWN and unset.path == "ddp.bucket_size"
    absent = view.raw("optimizer", "use_distributed_optimizer")  # a section the file lacks
    assert absent.value is UNKNOWN and absent.path == "optimizer.use_distributed_optimizer"


def test_mixed_precision_points_at_the_recipe_name_or_the_field() -> None:
    """A named recipe is what the user wrote, so a message must point there, not at a field the
    file never mentions; field values written in the file are pointed at field by field."""
    absent = ConfigView("bridge")
    assert not absent.mp_present
    assert absent.mp("fp8_param_gather") == Val(UNKNOWN, "mixed_precision.fp8_param_gather")
    named = ConfigView("bridge", mp_name="bf16_with_mxfp8_mixed", mp_values={"fp8_param_gather": True})
    assert named.mp_present
    assert named.mp("fp8_param_gather") == Val(True, "mixed_precision=bf16_with_mxfp8_mixed")
    fields = ConfigView("bridge", mp_values={"fp8_param_gather": True})
    assert fields.mp("fp8_param_gather") == Val(True, "mixed_precision.fp8_param_gather")
    missing = fields.mp("fp8_recipe")
    assert missing.value is UNKNOWN and missing.path == "mixed_precision.fp8_recipe"


def test_invalid_paths_are_the_rejected_knobs_not_the_warnings() -> None:
    """A warning (a key a subclass may have) is unknown, not wrong: it is not "written but rejected"."""
    view = ConfigView(
        "bridge",
        issues=[
            InputIssue("wrong_type", "ddp.bucket_size", "big", "bucket_size must be an int"),
            InputIssue("unknown_key", "ddp.my_knob", 1, "not a field", severity="warning"),
        ],
    )
    assert view.invalid_paths == {"ddp.bucket_size"}
    assert ConfigView("mcore").invalid_paths == set()


def test_records_are_frozen_and_views_do_not_share_state() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Val(1, "ddp.bucket_size").value = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        InputIssue("unknown_key", "x", 1, "m").knob = "y"  # type: ignore[misc]
    a, b = ConfigView("bridge"), ConfigView("bridge")
    a.sections["ddp"] = {"bucket_size": 1}
    a.issues.append(InputIssue("unknown_key", "x", 1, "m"))
    assert b.sections == {} and b.issues == []
