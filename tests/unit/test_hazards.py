"""The known hazards (MX007, MX014-MX016) on Megatron-Bridge's real ``ConfigContainer``, per cell.

The rules of config/rules/hazards.py (and MX007). Runs in every matrix cell: whether a hazard fires
is gated on what the installed files show (:func:`probe_hazard_files`), and
tests/unit/test_probes_hazards.py pins that probe to the release facts (docs/check.md's rule table)
for the installed versions, so a cell where the probe and the facts disagree fails instead of
silently testing the other branch. In the main venv (core 0.16.1 +
Bridge 0.3.1) MX007 and MX014-MX016 all apply; in the core0192 cell (0.19.2 + 0.6.2) only MX016
does, and MX007 is rejected by megatron-core itself. Each rule is also shown *not* to fire on the
same container with the hazard's knob set the safe way.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mbridge_mxfp8_plugin import validate_config
from mbridge_mxfp8_plugin.probes import probe_hazard_files
from mbridge_mxfp8_plugin.probes.defects import HAZARDS, hazards_exposed

pytest.importorskip("megatron.core")
if importlib.util.find_spec("megatron.bridge") is None:  # imported later, under the harness' TE stub
    pytest.skip("Megatron-Bridge is not installed", allow_module_level=True)

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)


EXPOSED = hazards_exposed(probe_hazard_files())


def _bridge_config_importable() -> bool:
    """Bridge's real ConfigContainer needs what its pretrain() imports (transformers, ...), which
    only the cells that run the real pretrain() install; the 3.11 matrix cells have Bridge's files
    only."""
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "einops"))


def _recipe(mode: str) -> dict[str, Any]:
    """The shipped tiny MXFP8 recipe as Bridge would merge it (plugin mode), or its bf16 twin."""
    from mbridge_mxfp8_plugin.adapters.recipes import read_recipe

    data = read_recipe("tiny_debug_mxfp8")
    # As the real job states it: with comm_overlap unstated its dp-size default decides (unknown).
    data["comm_overlap"] = {"overlap_param_gather": True, "overlap_grad_reduce": True}
    data["model"]["num_moe_experts"] = None  # dense, as the real job's provider has it
    # Knobs the real container holds at their defaults, stated (unstated, the rules say n/a).
    data["optimizer"]["optimizer_cpu_offload"] = False
    from mbridge_mxfp8_plugin.probes.fields import section_fields

    if "cuda_graph_impl" in (section_fields("model").fields or {"cuda_graph_impl": None}):
        data["model"]["cuda_graph_impl"] = "none"  # a field from megatron-core 0.15
    if mode == "reference":
        data["mixed_precision"] = "bf16_mixed"
        data["ddp"].update(fp8_param_gather=False, reuse_grad_buf_for_mxfp8_param_ag=False)
        data["optimizer"]["reuse_grad_buf_for_mxfp8_param_ag"] = False
    return data


@pytest.fixture(scope="module")
def container() -> Iterator[Callable[..., Any]]:
    """A factory of fresh configs: Bridge's real ConfigContainer (the real-pretrain harness' tiny
    MXFP8 job) where it can be built, else the same job as a recipe mapping, which the rules read
    through the same effective-config layer (and which is what ``check`` sees)."""
    if os.environ.get("MXFP8_HAZARDS_AS_RECIPE") or not _bridge_config_importable():

        def from_recipe(mode: str = "plugin", **sections: dict[str, Any]) -> Any:
            data = _recipe(mode)
            for section, values in sections.items():
                data.setdefault(section, {}).update(values)
            return data

        yield from_recipe
        return

    from harness.bridge_cpu import bridge_on_cpu
    from harness.bridge_real.config import JobSpec, build_config

    with bridge_on_cpu():

        def make(mode: str = "plugin", **sections: dict[str, Any]) -> Any:
            cfg = build_config(JobSpec(mode), world_size=2)
            for section, values in sections.items():
                for knob, value in values.items():
                    setattr(getattr(cfg, section), knob, value)
            return cfg

        yield make


def _result(cfg: Any, rule_id: str) -> Any:
    return validate_config(cfg, strict=False).by_rule(rule_id)


def _expect(result: Any, exposed: bool | None) -> None:
    assert result.status == ("fail" if exposed else "pass"), result
    if exposed:
        (finding,) = result.findings
        assert finding.fix and HAZARDS[result.rule.id].reference.split(" (")[0] in finding.message


def _no_overlap() -> dict[str, dict[str, Any]]:
    off = {"overlap_param_gather": False}
    return {"ddp": off, "optimizer": off, "comm_overlap": off}


def test_mx014_moe_without_overlapped_gather(container) -> None:
    result = _result(container(model={"num_moe_experts": 4}, **_no_overlap()), "MX014")
    _expect(result, EXPOSED["MX014"])
    if EXPOSED["MX014"]:
        assert result.findings[0].fix == {
            "comm_overlap": {"overlap_param_gather": True, "overlap_grad_reduce": True}
        }
    # does not apply: overlapped gather, or a dense model, or no reuse
    assert _result(container(model={"num_moe_experts": 4}), "MX014").status == "pass"
    assert _result(container(**_no_overlap()), "MX014").status == "pass"
    assert (
        _result(container("reference", model={"num_moe_experts": 4}, **_no_overlap()), "MX014").status
        == "pass"
    )


def _full_iteration_graph() -> dict[str, Any]:
    """The enum where the installed core has it (a real container holds the enum), else its name."""
    try:
        from megatron.core.transformer.enums import CudaGraphScope
    except ImportError:  # core < 0.16: the scope is a plain string there (a list is an MX102 error)
        return {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    return {"cuda_graph_impl": "local", "cuda_graph_scope": [CudaGraphScope.full_iteration]}


def test_mx015_full_iteration_cuda_graph(container) -> None:
    from mbridge_mxfp8_plugin.probes.fields import section_fields

    if "cuda_graph_impl" not in (section_fields("model").fields or {"cuda_graph_impl": None}):
        pytest.skip("megatron-core < 0.15 has no cuda_graph_impl: no full-iteration graph to ask for")
    graph = _full_iteration_graph()
    result = _result(container(model=graph), "MX015")
    _expect(result, EXPOSED["MX015"])
    assert (
        _result(container(model={**graph, "cuda_graph_scope": "full_iteration"}), "MX015").status
        == result.status
    )
    # does not apply: no graph, no reuse, or a non-overlapped gather (the optimizer stages itself)
    assert _result(container(), "MX015").status == "pass"
    assert _result(container("reference", model=graph), "MX015").status == "pass"
    assert _result(container(model=graph, **_no_overlap()), "MX015").status == "pass"


def test_mx016_fp8_params_with_cpu_offload(container) -> None:
    offload = {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True}
    result = _result(container(optimizer=offload), "MX016")
    _expect(result, EXPOSED["MX016"])
    # does not apply: bf16 params, or no offload
    assert _result(container("reference", optimizer=offload), "MX016").status == "pass"
    assert _result(container(), "MX016").status == "pass"


def test_mx007_step_overlap_with_reuse(container) -> None:
    """Refused in every cell (unsupported before 0.19, a ValueError from 0.19); the message says
    which of the two the installed core does."""
    on = {"overlap_param_gather_with_optimizer_step": True}
    result = _result(container(optimizer=on, comm_overlap=on), "MX007")
    assert result.status == "fail"
    rejects = "rejects it at config time (ValueError" in result.findings[0].message
    assert rejects is (not EXPOSED["MX007"])
    assert _result(container("reference", optimizer=on, comm_overlap=on), "MX007").status == "pass"
