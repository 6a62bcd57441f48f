"""The weight check's report (verify/report.py): its verdict, its one log line, and the raise.

docs/verify.md: ``report.raise_if_bad()`` raises :class:`MXFP8PluginError` naming the event and the
first params; ``ok`` is false when this rank's shard check, a data-parallel peer's, or the replica
check found a difference (WRONG), or when an MXFP8 weight's type could not be read (NOT CHECKED,
unless ``verify_accept_unchecked``); another param that could not be read is a note, not a
failure. Reports here are filled by hand with what a check would count; the ranks tier asserts
on the ones real checks fill.
"""

from __future__ import annotations

import pytest

from mbridge_mxfp8_plugin import MXFP8PluginError
from mbridge_mxfp8_plugin.verify import ParamMismatch, WeightReport


def _clean(**kw) -> WeightReport:
    fields = {"params_checked": 6, "elements_checked": 4096, "params_hashed": 6, "groups_reduced": 1}
    return WeightReport("after eval", **{**fields, **kw})


def test_a_clean_report_is_ok_and_says_what_was_compared() -> None:
    rep = _clean()
    assert rep.ok
    line = rep.message()
    assert line.startswith("MXFP8 weight check at after eval: OK")
    assert "6 owned params, 4096 elements" in line and "1 data-parallel group(s)" in line
    assert "sample" not in line and "unchecked" not in line
    rep.raise_if_bad()  # nothing to raise


def test_unchecked_params_and_sampling_are_stated_but_not_failures() -> None:
    rep = _clean(unchecked=["w: per-tensor FP8", "v: opaque"], sample=0.25)
    assert rep.ok
    assert "(sample 0.25)" in rep.message() and "2 params unchecked" in rep.message()
    rep.raise_if_bad()


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"shard_mismatches": [ParamMismatch("layers.0.weight", 0.5, 12)], "shard_mismatch_count": 3},
            "3 params differ from their quantized fp32 main params on this rank "
            "(first: layers.0.weight (max |diff| 0.5, 12 elements))",
        ),
        ({"peer_mismatch_count": 2}, "a data-parallel peer found 2 params that differ"),
        (
            {"replica_mismatches": ["layers.1.bias"], "replica_mismatch_count": 1},
            "1 params differ between data-parallel replicas (first: layers.1.bias)",
        ),
    ],
    ids=["shard", "peer", "replica"],
)
def test_each_kind_of_difference_fails_and_is_named(fields, said: str) -> None:
    rep = _clean(**fields)
    assert not rep.ok
    assert rep.message().startswith("MXFP8 weight check at after eval: WRONG: ")
    assert said in rep.message()
    with pytest.raises(MXFP8PluginError, match="after eval: WRONG") as err:
        rep.raise_if_bad()
    assert said in str(err.value) and "docs/verify.md" in str(err.value)


def test_own_and_replica_differences_are_both_reported() -> None:
    """This rank's own differences say more than a peer's count, which is then left out."""
    rep = _clean(
        shard_mismatches=[ParamMismatch("w", 1.0, 1)],
        shard_mismatch_count=1,
        peer_mismatch_count=4,
        replica_mismatches=["b"],
        replica_mismatch_count=1,
    )
    line = rep.message()
    assert "1 params differ from their quantized" in line and "between data-parallel replicas" in line
    assert "peer" not in line


def test_reference_paths_are_counted_per_path() -> None:
    rep = WeightReport("e")
    rep.count_path("TEShapedMXFP8Tensor via copy_, read codes")
    rep.count_path("TEShapedMXFP8Tensor via copy_, read codes", params=3)
    rep.count_path("bf16")
    assert rep.reference_paths == {"TEShapedMXFP8Tensor via copy_, read codes": 4, "bf16": 1}
    assert WeightReport("other").reference_paths == {}  # not shared between reports


def test_an_unreadable_mxfp8_weight_is_not_checked_never_a_pass() -> None:
    """Issue 32.4: the check cannot vouch for weights of a type it cannot read, which are the
    weights the defects corrupt; only ``verify_accept_unchecked`` takes that as a pass."""
    rep = _clean()
    rep.add_unchecked("layers.0.weight", "swizzled scales", mxfp8_type="MXFP8Tensor")
    rep.add_unchecked("layers.1.weight", "swizzled scales", mxfp8_type="MXFP8Tensor")
    assert rep.verdict == "not checked" and not rep.ok
    assert rep.mxfp8_unchecked == 2 and rep.unchecked_types == ["MXFP8Tensor"]
    line = rep.message()
    assert line.startswith("MXFP8 weight check at after eval: NOT CHECKED: 2 of 8 owned params")
    assert "MXFP8Tensor" in line and "layers.0.weight: swizzled scales" in line
    with pytest.raises(MXFP8PluginError, match="NOT CHECKED.*verify_accept_unchecked"):
        rep.raise_if_bad()
    rep.accept_unchecked = True
    assert rep.ok and "accepted (verify_accept_unchecked)" in rep.message()
    rep.raise_if_bad()
    # A difference found elsewhere is WRONG whatever could not be read.
    rep.shard_mismatch_count = 1
    assert rep.verdict == "wrong" and not rep.ok


def test_an_unreadable_param_that_is_not_an_mxfp8_weight_stays_a_note() -> None:
    rep = _clean()
    rep.add_unchecked("bias", "per-tensor FP8 storage")
    assert rep.verdict == "ok" and rep.ok and rep.unchecked == ["bias: per-tensor FP8 storage"]
    assert "1 params unchecked" in rep.message()
