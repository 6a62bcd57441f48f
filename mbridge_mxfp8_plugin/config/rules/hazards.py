"""MX014-MX016: known upstream failures with MXFP8 reuse that the plugin cannot repair.

Each rule first asks the config whether it is in the hazard (pass when it is not, whatever the
release), then the installed pair whether it is exposed (:attr:`..effective.EffectiveConfig.installed`
``.hazards``, probed from the files by :mod:`...probes.hazards`). Unprobed or unknown: the config
is refused anyway where the failure is silent, since a refusal costs a YAML edit and the failure
a run. The facts, references and fixes are :data:`...defects.HAZARDS`, which ``doctor`` renders.
"""

from __future__ import annotations

from typing import Any

from ...common.yamltypes import yaml_literal as _y
from ...probes.defects import HAZARDS
from ...probes.fields import section_fields
from ..effective import EffectiveConfig
from ..report import Rule, RuleResult
from ..view import Val
from ._base import _na, _pass, _rule, _violation


def _installed(ctx: EffectiveConfig, answer: str) -> bool | None:
    """The probe's answer for this pair; None when nothing was probed."""
    probe = ctx.installed.hazards if ctx.installed is not None else None
    return None if probe is None else getattr(probe, answer)


def _where(ctx: EffectiveConfig) -> str:
    return ctx.installed.describe() if ctx.installed is not None else "the installed release pair"


def _cite(rule_id: str) -> str:
    h = HAZARDS[rule_id]
    return f"{h.reference}; fixed in: {h.fixed_in}"


def _overlap_fix(ov: Val) -> dict[str, Any]:
    """Turn the param gather's overlap on where the effective value comes from."""
    if ov.path.startswith("comm_overlap."):
        return {"comm_overlap": {"overlap_param_gather": True, "overlap_grad_reduce": True}}
    return {
        "ddp": {"overlap_param_gather": True, "overlap_grad_reduce": True},
        "optimizer": {"overlap_param_gather": True},
    }


@_rule("MX014", "MoE + reuse needs overlapped param gather before core 0.18")
def _mx014(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    reuse = ctx.reuse_state()
    if reuse is False:
        return _pass(rule, "reuse off")
    ov = ctx.ddp("overlap_param_gather")
    if ov.known and ov.value:
        # Each optimizer then stages before the next forward: nothing zeroes another's shard.
        return _pass(rule, "param gather overlapped: each optimizer stages before the next forward", ov.path)
    moe, evidence = ctx.moe()
    if moe is False:
        return _pass(
            rule, f"dense model ({evidence}): one distributed optimizer per chunk", evidence.split("=")[0]
        )
    if reuse is None:
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config")
    if not ov.known:
        return _na(rule, f"overlap_param_gather {ctx.why_unknown(ov, 'ddp.overlap_param_gather')}", ov.path)
    if _installed(ctx, "defers_chained_mxfp8_sync"):
        return _pass(rule, f"{_where(ctx)} defers the chained MXFP8 param sync", ov.path, False)
    # Dense and expert optimizers share the chunk's buffer; without overlap each one's sync
    # zeroes it before the other staged: expert weights become zeros, then NaN.
    hazard = (
        f"with reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather=false on {_where(ctx)}: "
        f"{HAZARDS['MX014'].symptom} ({_cite('MX014')}). Turn overlap_param_gather on, or install "
        "megatron-core >= 0.18"
    )
    if moe is None:
        why = (
            f"cannot tell whether the model has experts ({evidence}; name the base recipe with "
            f"--recipe or state model.num_moe_experts); if it does: MoE {hazard}"
        )
        return _violation(rule, "warning", ov.path, False, why, _overlap_fix(ov))
    return _violation(rule, "error", ov.path, False, f"MoE ({evidence}) {hazard}", _overlap_fix(ov))


def _model_fields() -> Any:
    """The model fields the installed release has; everything (``ALL``) when not readable."""
    fields = section_fields("model").fields
    return fields if fields is not None else _ALL


class _All:
    def __contains__(self, item: object) -> bool:
        return True


_ALL = _All()


def _names(value: Any) -> set[str]:
    """Member names of a CUDA-graph scope: a string (comma-separated), an enum member, or a list."""
    if value is None:
        return set()
    items = (
        value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    )
    return {str(getattr(i, "name", i)).rsplit(".", 1)[-1].strip() for i in items}


@_rule("MX015", "full-iteration CUDA graphs with reuse need Bridge >= 0.5")
def _mx015(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    impl = ctx.model("cuda_graph_impl")
    scopes = [ctx.model("cuda_graph_scope"), ctx.model("cuda_graph_modules")]
    full_scope = any(v.known and "full_iteration" in _names(v.value) for v in scopes)
    if ctx.reuse_state() is False:
        return _pass(rule, "reuse off", impl.path, impl.value)
    if ctx.view.kind == "recipe" and "cuda_graph_impl" not in _model_fields():
        # megatron-core < 0.15 has no cuda_graph_impl: no full-iteration graph can be asked for
        # (Bridge drops the key, MX101 says so).
        return _pass(rule, "the installed megatron-core has no cuda_graph_impl", impl.path)
    if not impl.known:
        return _na(rule, f"cuda_graph_impl {ctx.why_unknown(impl)}", impl.path)
    # Only a captured full iteration replays the all-gather while the loop skips staging.
    if not (impl.value == "full_iteration" or (impl.value == "local" and full_scope)):
        return _pass(rule, "no full-iteration CUDA graph", impl.path, impl.value)
    if not ctx.reuse_anywhere():
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config", impl.path)
    ov = ctx.ddp("overlap_param_gather")
    if not ov.known:
        return _na(rule, f"overlap_param_gather {ctx.why_unknown(ov, 'ddp.overlap_param_gather')}", ov.path)
    if not ov.value:
        return _pass(rule, "param gather not overlapped: the optimizer stages the buffer itself", ov.path)
    if _installed(ctx, "stages_for_full_iteration_graph"):
        return _pass(rule, f"{_where(ctx)} stages before a captured graph replays", impl.path, impl.value)
    fix: dict[str, Any] = {"model": {"cuda_graph_impl": "none"}}
    return _violation(
        rule,
        "error",
        impl.path,
        impl.value,
        f"full-iteration CUDA graphs (cuda_graph_impl={_y(impl.value)}) with MXFP8 reuse on {_where(ctx)}: "
        f"{HAZARDS['MX015'].symptom} ({_cite('MX015')}). Install Megatron-Bridge >= 0.5, or capture "
        "no full-iteration graph (cuda_graph_impl: none, or transformer_engine with layer scopes)",
        fix,
    )


_NO_OFFLOAD = {"optimizer": {"optimizer_cpu_offload": False}}


@_rule("MX016", "FP8 params with optimizer CPU offload")
def _mx016(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    offload = ctx.opt("optimizer_cpu_offload")
    fp8, recipe = ctx.fp8_params(), ctx.opt("fp8_recipe")
    if offload.known and not offload.value:
        return _pass(rule, "optimizer CPU offload off", offload.path, offload.value)
    if fp8.known and not fp8.value:
        return _pass(rule, "params are not kept in FP8", fp8.path, False)
    if not offload.known:
        return _na(rule, f"optimizer_cpu_offload {ctx.why_unknown(offload)}", offload.path)
    # the optimizer's copy decides: its distributed optimizer drops non-delayed FP8 shards
    if not fp8.known:
        return _na(rule, f"{fp8.path} {ctx.why_unknown(fp8)}", fp8.path)
    # Delayed-scaling FP8 params keep a shard view; other recipes lose theirs under offload.
    if recipe.known and recipe.value == "delayed":
        return _pass(rule, "delayed-scaling FP8 params keep a shard view", recipe.path, recipe.value)
    if _installed(ctx, "cpu_offload_drops_fp8_params") is False:
        return _pass(rule, f"{_where(ctx)} builds FP8 main params under CPU offload", offload.path, True)
    aware = ctx.opt("use_precision_aware_optimizer")
    why = (
        f"{fp8.path}=true with optimizer.optimizer_cpu_offload=true on {_where(ctx)}: "
        f"{HAZARDS['MX016'].symptom} ({_cite('MX016')})"
    )
    if aware.known and not aware.value:
        why += (
            "; use_precision_aware_optimizer=false here avoids that path, but Megatron-LM supports CPU "
            "offload only with it"
        )
        return _violation(rule, "warning", offload.path, True, why, _NO_OFFLOAD)
    why += ". Turn optimizer_cpu_offload off (or keep params in bf16: fp8_param_gather=false)"
    return _violation(rule, "error", offload.path, True, why, _NO_OFFLOAD)
