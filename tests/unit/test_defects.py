"""The one defect table (probes/defects.py): which defects a probed stack has is decided in one
place, from the core's files, the loop's staging and the resume probe; unknown is never "fixed"."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


def _core_files(*, a: bool, b1: bool, c: bool) -> object:
    from mbridge_mxfp8_plugin.probes import CoreBehaviour

    return CoreBehaviour(
        pads_bucket_offsets=a,
        forced_sync_writes_back=b1,
        has_dispatch_reset=c,
        has_prepare_for_param_sync=c,
        has_reuse_knob=True,
    )


@pytest.mark.parametrize(
    ("fixed", "loop", "present"),
    [
        # docs/upstream.md: core 0.16.1 + Bridge 0.3/0.4 (no staging): everything.
        ((False, False, False), (False, False), {"A", "B1", "B2", "C", "E"}),
        # core 0.18.2 + Bridge 0.5.1: stages before evals only -> saves still gather gradients (B2).
        ((True, True, False), (True, False), {"B2", "C", "E"}),
        # core 0.19.2 + Bridge 0.6.2: fixed upstream; only the eval-only case remains.
        ((True, True, True), (True, True), {"E"}),
        # no Bridge installed: any hand-written loop is assumed not to stage.
        ((True, True, True), None, {"B2", "E"}),
    ],
)
def test_defects_present_is_decided_in_one_place(fixed, loop, present) -> None:
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin.probes.defects import DEFECTS, defects_present

    staging = (
        None
        if loop is None
        else SimpleNamespace(stages_before_eval=loop[0], stages_before_every_forced_sync=loop[1])
    )
    got = defects_present(_core_files(a=fixed[0], b1=fixed[1], c=fixed[2]), staging)
    assert list(got) == list(DEFECTS)
    assert {d for d, p in got.items() if p} == present


@pytest.mark.parametrize(
    ("keeps_prehooks", "loader_rederives", "present"),
    [
        (False, False, True),  # Bridge <= 0.5 / Megatron-LM core_v0.19: pre-hooks off after a load
        (True, False, False),  # Bridge >= 0.6 (#5066): the first step stages and gathers the main params
        (None, True, False),  # Megatron-LM main (#6666): the loader re-derives after a load
        (None, False, True),  # no Bridge, no re-deriving loader: a hand-written loop is assumed not to
    ],
)
def test_f_is_decided_from_the_resume_probe(keeps_prehooks, loader_rederives, present) -> None:
    from mbridge_mxfp8_plugin.probes.defects import defects_present
    from mbridge_mxfp8_plugin.probes.resume import ResumeBehaviour

    resume = ResumeBehaviour(keeps_prehooks_on_mxfp8_resume=keeps_prehooks, loader_rederives=loader_rederives)
    assert defects_present(None, None, resume)["F"] is present
    assert defects_present(None, None)["F"] is None  # not probed: unknown, never "fixed"
