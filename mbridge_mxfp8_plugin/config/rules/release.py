"""MX009-MX011: what the installed release pair needs (defects of :mod:`...defects`)."""

from __future__ import annotations

from ...options import PLUGIN_SECTION
from ...probes.defects import DEFECTS
from ...probes.owners import LAYER_WISE, MEGATRON_FSDP, SyncOwner
from ..effective import EffectiveConfig
from ..report import Rule, RuleResult
from ..view import UNKNOWN, Val
from ._base import _na, _pass, _rule, _violation


def _relevant_defects(ctx: EffectiveConfig) -> list[str] | None:
    """The installed core's defects that this config runs into; None when the knobs that decide
    it (reuse, the distributed optimizer, overlap for B1/C) come from the base config."""
    if ctx.installed is None or ctx.installed.core is None:
        return []
    dist, ov = ctx.ddp("use_distributed_optimizer"), ctx.ddp("overlap_param_gather")
    reuse = ctx.reuse_state()
    # Every defect needs the shared buffer: reuse and the distributed optimizer, both on.
    if reuse is False or (dist.known and not dist.value):
        return []
    if reuse is None or not dist.known:
        return None
    present = ctx.installed.defects
    # A (offsets) bites on any gather; B1/C only on forced syncs with overlapped gathers.
    if not ov.known and any(d != "A" for d in present):
        return None
    overlap = ov.known and bool(ov.value)
    return [d for d in present if d == "A" or overlap]


def _sync_owner(ctx: EffectiveConfig) -> SyncOwner | None:
    """Megatron-FSDP or the LayerWise (Muon) optimizer, as the config states it: they own the param
    sync, so the plugin stays passive and none of the defects it fixes apply. LayerWise is chosen by
    ``use_layer_wise_distributed_optimizer`` (core >= 0.18) or a ``dist_*`` optimizer name (what
    Bridge and megatron-core read as layer-wise)."""
    fsdp, lw, name = ctx.fsdp(), ctx.opt("use_layer_wise_distributed_optimizer"), ctx.opt("optimizer")
    if fsdp.known and fsdp.value:
        return SyncOwner(MEGATRON_FSDP, fsdp.path)
    if lw.known and lw.value:
        return SyncOwner(LAYER_WISE, lw.path)
    if name.known and isinstance(name.value, str) and name.value.startswith("dist_"):
        return SyncOwner(LAYER_WISE, f"{name.path}={name.value}")
    return None


#: How a job gets the plugin when its YAML says nothing about it.
_SWITCH_ON = (
    "launch the job with `python -m mbridge_mxfp8_plugin.launch` and add `mxfp8_plugin: {enabled: true}` "
    "to this file, or pass `callbacks=[MXFP8ParamSyncCallback()]` to pretrain() in the training script"
)


@_rule("MX009", "plugin on where the installed release needs it")
def _mx009(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    enabled = Val(ctx.view.plugin.get("enabled", True), f"{PLUGIN_SECTION}.enabled")
    if ctx.installed is None or ctx.installed.core is None:
        return _na(rule, "no megatron-core here: which defects are present is unknown", enabled.path)
    owner = _sync_owner(ctx)
    if owner is not None:
        why = f"the plugin stays passive: {owner.owner} owns the param sync ({owner.found}); {owner.why}"
        return _pass(rule, why, owner.found.partition("=")[0], True)
    defects = _relevant_defects(ctx)
    # Turning the plugin off is fine where the installed pair has no defect this config meets.
    if enabled.value and ctx.view.plugin_stated:
        return _pass(rule, "plugin enabled", enabled.path, True)
    if defects is None:
        return _na(
            rule, "whether the installed defects apply depends on knobs the base config sets", enabled.path
        )
    if ctx.view.kind == "recipe" and not ctx.view.plugin_stated:
        if not defects:
            return _pass(rule, "no defect of the installed release applies to this config", PLUGIN_SECTION)
        why = (
            f"this file has no {PLUGIN_SECTION} section, and {ctx.installed.describe()} has defect(s) "
            f"{', '.join(defects)} for this config: the job has the plugin only if its launcher or "
            f"script adds it. To switch it on, {_SWITCH_ON}"
        )
        return _violation(rule, "warning", PLUGIN_SECTION, UNKNOWN, why, {PLUGIN_SECTION: {"enabled": True}})
    if enabled.value:
        return _pass(rule, "plugin enabled", enabled.path, True)
    if not defects:
        return _pass(rule, "no defect of the installed release applies to this config", enabled.path, False)
    why = f"the plugin is disabled but {ctx.installed.describe()} has defect(s) {', '.join(defects)} for "
    why += "this config: " + "; ".join(f"{d}: {DEFECTS[d].symptom}" for d in defects)
    return _violation(rule, "error", enabled.path, False, why, {PLUGIN_SECTION: {"enabled": True}})


@_rule("MX010", "alignment repair where defect A is present")
def _mx010(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    repair = Val(ctx.view.plugin.get("repair_alignment", True), f"{PLUGIN_SECTION}.repair_alignment")
    if not ctx.view.plugin.get("enabled", True):
        return _pass(rule, "plugin disabled (see MX009)", repair.path, repair.value)
    if repair.value:
        return _pass(rule, "repair on", repair.path, True)
    # Without the repair the callback raises on defect A's wrong offsets instead of fixing them.
    if ctx.installed is None or ctx.installed.core is None or ctx.installed.core.pads_bucket_offsets is None:
        return _na(rule, "cannot tell whether the installed megatron-core has defect A", repair.path)
    defects = _relevant_defects(ctx)
    if defects is None:
        return _na(rule, "whether defect A applies depends on knobs the base config sets", repair.path)
    if "A" not in defects:
        return _pass(rule, "defect A absent or not relevant", repair.path, False)
    why = (
        f"repair_alignment=false on {ctx.installed.describe()}: bucket offsets there ignore the "
        "64-element padding, so MXFP8ParamSyncCallback raises MXFP8AlignmentError at train start"
    )
    return _violation(rule, "error", repair.path, False, why, {PLUGIN_SECTION: {"repair_alignment": True}})


@_rule("MX011", "known-broken release pair")
def _mx011(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    inst = ctx.installed
    if inst is None or inst.core is None or inst.bridge_calls_prepare is None:
        return _na(rule, "megatron-bridge or megatron-core not installed here")
    if not inst.bridge_calls_prepare or inst.core.has_prepare_for_param_sync:
        return _pass(rule, f"installed pair agrees on the param-sync API: {inst.describe()}")
    dist, ov, fsdp = ctx.ddp("use_distributed_optimizer"), ctx.ddp("overlap_param_gather"), ctx.fsdp()
    # The loop calls the missing API only around pre-hooks, which exist with the distributed
    # optimizer and overlapped param gathers (not under Megatron-FSDP).
    if (dist.known and not dist.value) or (ov.known and not ov.value) or (fsdp.known and fsdp.value):
        return _pass(rule, "the loop never disables the pre-hooks for this config", ov.path, ov.value)
    if not (dist.known and ov.known):
        return _na(rule, f"overlap_param_gather / use_distributed_optimizer {ctx.why_unknown(ov)}", ov.path)
    return _violation(
        rule,
        "error",
        ov.path,
        True,
        f"{inst.describe()}: this Bridge calls "
        "optimizer.prepare_model_params_for_param_sync() before "
        "every eval, checkpoint save and weight-hash check, and this megatron-core does not have it "
        "(added in 0.19): AttributeError at the first eval or save. Install megatron-core >= 0.19, "
        "or Megatron-Bridge <= 0.5, or turn overlap_param_gather off",
        {"ddp": {"overlap_param_gather": False}, "optimizer": {"overlap_param_gather": False}},
    )
