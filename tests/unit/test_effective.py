"""Bridge's precedence (config/effective.py) on a ``ConfigContainer``: ``mixed_precision`` owns the fp8
knobs (as a recipe name or a resolved object), and ``dist.use_megatron_fsdp`` counts as ddp's."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

from harness.check_io import findings as _findings
from harness.mx_cases import DEFECTIVE

from mbridge_mxfp8_plugin.config.validate import validate_config


def _container(**overrides: Any) -> SimpleNamespace:
    """Duck-typed ConfigContainer (Bridge cannot be imported here) holding real megatron-core configs."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        )
        opt = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, overlap_param_gather=True)
    cfg = SimpleNamespace(
        ddp=ddp,
        optimizer=opt,
        model=SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1),
        dist=SimpleNamespace(use_megatron_fsdp=False),
        mixed_precision="bf16_with_mxfp8_mixed",
        train=SimpleNamespace(eval_interval=10),
        checkpoint=SimpleNamespace(save_interval=100),
        data_parallel_size=4,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def test_bridge_container_mixed_precision_owns_the_knobs():
    """Before runtime_config_update, ddp still holds core defaults (reuse off): not a conflict."""
    report = validate_config(_container(), installed=DEFECTIVE)
    assert report.kind == "bridge" and report.ok and report.dp_size == 4
    assert report.by_rule("MX001").status == "pass" and report.by_rule("MX005").status == "pass"


def test_bridge_container_with_resolved_mixed_precision_object():
    @dataclasses.dataclass
    class MP:  # the fields of Bridge's MixedPrecisionConfig that matter here
        fp8: str = "e4m3"
        fp8_recipe: str = "mxfp8"
        fp8_param_gather: bool = True
        reuse_grad_buf_for_mxfp8_param_ag: bool = False

    report = validate_config(_container(mixed_precision=MP()), strict=False, installed=DEFECTIVE)
    assert [(f.rule, f.knob) for f in report.errors] == [
        ("MX001", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag")
    ]


def test_bridge_container_unknown_recipe_name_and_fsdp():
    report = validate_config(
        _container(mixed_precision="bf16_with_mxfp9_mixed"), strict=False, installed=DEFECTIVE
    )
    assert [f.rule for f in report.errors] == ["MX103"]
    report = validate_config(
        _container(dist=SimpleNamespace(use_megatron_fsdp=True)), strict=False, installed=DEFECTIVE
    )
    assert [(f.rule, f.severity, f.knob) for f in _findings(report, "MX004")] == [
        ("MX004", "warning", "dist.use_megatron_fsdp")
    ]
