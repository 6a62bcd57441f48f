"""Shared by test_validate.py and test_check.py: one violating config per rule, twice over.

Each case breaks exactly one thing in a known-good config: as Hydra-style overrides on the
shipped tiny recipe (the YAML path) and as a mutation of real megatron-core config dataclasses
(the Python path). Mutating after construction is deliberate: it is how Bridge's configs behave
(their ``__post_init__`` is deferred to ``finalize()``) and it bypasses megatron-core's own
asserts, which the validator must turn into clear errors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_mxfp8_plugin.probes import CoreBehaviour, InstalledStack

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny_debug_mxfp8.yaml"

#: megatron-core <= 0.16 + Bridge 0.3: defects A, B1, C; Bridge does not call prepare_...().
# Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
DEFECTIVE = InstalledStack(
    core=CoreBehaviour(
        forced_sync_writes_back=False,
        has_dispatch_reset=False,
        has_prepare_for_param_sync=False,
        has_reuse_knob=True,
        pads_bucket_offsets=False,
    ),
    bridge_calls_prepare=False,
    versions={"megatron-core": "0.16.1", "megatron-bridge": "0.3.1"},
)
#: megatron-core 0.19 + Bridge 0.6: nothing to fix.
FIXED = InstalledStack(
    core=CoreBehaviour(True, True, True, True, pads_bucket_offsets=True),
    bridge_calls_prepare=True,
    versions={"megatron-core": "0.19.2", "megatron-bridge": "0.6.2"},
)
#: Bridge 0.6 (calls prepare_model_params_for_param_sync) on megatron-core 0.18 (lacks it).
BROKEN_PAIR = InstalledStack(
    core=CoreBehaviour(True, False, False, True, pads_bucket_offsets=True),
    bridge_calls_prepare=True,
    versions={"megatron-core": "0.18.2", "megatron-bridge": "0.6.2"},
)


def core_configs(ddp: dict[str, Any] | None = None, opt: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid MXFP8 reuse setup as megatron-core objects, then ``ddp``/``opt`` attributes forced."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            grad_reduce_in_fp32=True,
            fp8_param_gather=True,
            reuse_grad_buf_for_mxfp8_param_ag=True,
        )
        o = OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            bf16=True,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            fp8_recipe="mxfp8",
            reuse_grad_buf_for_mxfp8_param_ag=True,
        )
    for k, v in (ddp or {}).items():
        setattr(d, k, v)
    for k, v in (opt or {}).items():
        setattr(o, k, v)
    return {"ddp": d, "optimizer": o}


@dataclass(frozen=True)
class Case:
    rule: str
    knob: str  # the finding's knob path must contain this
    severity: str
    overrides: tuple[str, ...]  # on the tiny recipe
    core: dict[str, Any] | None = None  # kwargs: ddp/opt mutations, plugin; None: not expressible
    core_knob: str | None = None  # if the core path names a different knob
    core_severity: str | None = None
    dp_size: int | None = None
    installed: InstalledStack = field(default=DEFECTIVE)

    @property
    def id(self) -> str:
        return self.rule


# One literal Case per rule, alike in shape on purpose (duplicates lists neighbours): a table of data.
CASES = [
    Case(
        "MX001",
        "ddp.reuse_grad_buf_for_mxfp8_param_ag",
        "error",
        (
            "mixed_precision=null",
            "+model.fp8_recipe=mxfp8",
            "ddp.reuse_grad_buf_for_mxfp8_param_ag=false",
            "optimizer.reuse_grad_buf_for_mxfp8_param_ag=false",
        ),
        {
            "ddp": {"reuse_grad_buf_for_mxfp8_param_ag": False},
            "opt": {"reuse_grad_buf_for_mxfp8_param_ag": False},
        },
    ),
    Case(
        "MX002",
        "ddp.fp8_param_gather",
        "error",
        ("mixed_precision=null", "ddp.fp8_param_gather=false"),
        {"ddp": {"fp8_param_gather": False}},
    ),
    Case(
        "MX003",
        "ddp.use_distributed_optimizer",
        "error",
        ("ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"),
        {"ddp": {"use_distributed_optimizer": False}, "opt": {"use_distributed_optimizer": False}},
    ),
    Case(
        "MX004",
        "ddp.use_megatron_fsdp",
        "warning",
        ("ddp.use_megatron_fsdp=true",),
        {"ddp": {"use_megatron_fsdp": True}},
        core_severity="error",
    ),
    Case(
        "MX005",
        "ddp.reuse_grad_buf_for_mxfp8_param_ag",
        "error",
        ("ddp.reuse_grad_buf_for_mxfp8_param_ag=false",),
        {"opt": {"reuse_grad_buf_for_mxfp8_param_ag": False}},
        core_knob="optimizer.reuse_grad_buf_for_mxfp8_param_ag",
    ),
    Case(
        "MX006",
        "ddp.overlap_grad_reduce",
        "error",
        ("ddp.overlap_grad_reduce=false",),
        {"ddp": {"overlap_grad_reduce": False}},
    ),
    Case(
        "MX007",
        "optimizer.overlap_param_gather_with_optimizer_step",
        "error",
        ("optimizer.overlap_param_gather_with_optimizer_step=true",),
        {"opt": {"overlap_param_gather_with_optimizer_step": True}},
    ),
    Case(
        "MX008",
        "ddp.num_distributed_optimizer_instances",
        "error",
        ("ddp.num_distributed_optimizer_instances=3",),
        {"ddp": {"num_distributed_optimizer_instances": 3}},
        dp_size=8,
    ),
    Case(
        "MX009",
        "mxfp8_plugin.enabled",
        "error",
        ("mxfp8_plugin.enabled=false",),
        {"plugin": {"enabled": False}},
    ),
    Case(
        "MX010",
        "mxfp8_plugin.repair_alignment",
        "error",
        ("mxfp8_plugin.repair_alignment=false",),
        {"plugin": {"repair_alignment": False}},
    ),
    Case("MX011", "ddp.overlap_param_gather", "error", (), {}, installed=BROKEN_PAIR),
    Case(
        "MX012",
        "ddp.fp8_param_gather",
        "warning",
        (
            "mixed_precision=null",
            "+model.fp8_recipe=mxfp8",
            "ddp.fp8_param_gather=false",
            "ddp.reuse_grad_buf_for_mxfp8_param_ag=false",
            "optimizer.reuse_grad_buf_for_mxfp8_param_ag=false",
        ),
        {
            "ddp": {"fp8_param_gather": False, "reuse_grad_buf_for_mxfp8_param_ag": False},
            "opt": {"reuse_grad_buf_for_mxfp8_param_ag": False},
        },
    ),
    Case("MX013", "ddp.overlap_grad_reduce", "warning", ("~ddp.overlap_grad_reduce",)),
    Case("MX101", "ddp.overlap_param_gathr", "error", ("+ddp.overlap_param_gathr=true",)),
    Case(
        "MX102",
        "ddp.overlap_param_gather",
        "error",
        ("ddp.overlap_param_gather='yes'",),
        {"ddp": {"overlap_param_gather": "true"}},
    ),
    Case("MX103", "mixed_precision", "error", ("mixed_precision=bf16_with_mxfp9_mixed",)),
]


def core_kwargs(case: Case) -> dict[str, Any]:
    assert case.core is not None
    spec = dict(case.core)
    kwargs: dict[str, Any] = core_configs(spec.pop("ddp", None), spec.pop("opt", None))
    if "plugin" in spec:
        kwargs["plugin"] = spec.pop("plugin")
    assert not spec, spec
    return kwargs
