"""The hazard probe (probes/hazards.py) on the installed files, per cell: pinned to the release facts
(docs/check.md's rule table) for the installed versions, so a cell where the probe and the facts
disagree fails instead of silently testing the other branch; megatron-core's own ``OptimizerConfig``
agrees with the MX007 probe, and ``doctor`` lists the same exposure. The rules it gates, on Bridge's
real ``ConfigContainer``: tests/unit/test_hazards.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from importlib import metadata

import pytest

from mbridge_mxfp8_plugin.probes import probe_hazard_files
from mbridge_mxfp8_plugin.probes.defects import hazards_exposed

pytest.importorskip("megatron.core")
if importlib.util.find_spec("megatron.bridge") is None:  # as tests/unit/test_hazards.py
    pytest.skip("Megatron-Bridge is not installed", allow_module_level=True)

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)

EXPOSED = hazards_exposed(probe_hazard_files())


def _release(dist: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", metadata.version(dist)).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


#: The release that fixed (or rejects) each hazard (docs/check.md's rule table; the change per line).
def _facts() -> dict[str, bool]:
    core, bridge = _release("megatron-core"), _release("megatron-bridge")
    return {
        "MX007": core < (0, 19),  # core 0.19.0 rejects it in OptimizerConfig
        "MX014": core < (0, 18),  # Megatron-LM #4800
        "MX015": bridge < (0, 5),  # Megatron-Bridge #3076
        "MX016": True,  # Megatron-LM #5083: open
    }


#: What the matrix cells install (.ci/matrix.sh), so a cell cannot run against the wrong pair.
CELL_PAIRS = {
    "core0140": ("0.14", "0.3"),
    "core0153": ("0.15", "0.3"),
    "core0161": ("0.16", "0.3"),
    "core0171": ("0.17", "0.4"),
    "core0182": ("0.18", "0.5"),
    "core0192": ("0.19", "0.6"),
}


def test_probe_agrees_with_release_facts() -> None:
    cell = os.environ.get("MXFP8_MATRIX_CELL")
    if cell:
        core, bridge = CELL_PAIRS[cell]
        assert metadata.version("megatron-core").startswith(core)
        assert metadata.version("megatron-bridge").startswith(bridge)
    assert EXPOSED == _facts()


def test_mx007_probe_matches_core_validation() -> None:
    """The probe read the text; megatron-core's own OptimizerConfig says it by behaviour."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(
        use_distributed_optimizer=True,
        reuse_grad_buf_for_mxfp8_param_ag=True,
        overlap_param_gather_with_optimizer_step=True,
    )
    rejected = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            OptimizerConfig(**kwargs)
        except ValueError as exc:
            rejected = "overlap_param_gather_with_optimizer_step" in str(exc)
    assert probe_hazard_files().rejects_step_overlap_with_reuse is rejected


def test_doctor_lists_the_same_exposure() -> None:
    from mbridge_mxfp8_plugin.commands.doctor import diagnose

    report = diagnose()
    assert {h: info["exposed"] for h, info in report["hazards"].items()} == _facts()
