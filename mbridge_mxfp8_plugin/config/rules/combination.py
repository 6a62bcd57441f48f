"""MX001-MX007, MX012, MX013: knob combinations megatron-core or Bridge reject, or accept and train wrong."""

from __future__ import annotations

from typing import Any

from ...common.yamltypes import yaml_literal as _y
from ...probes.bridge_facts import MP_OWNED_KNOBS
from ...probes.defects import HAZARDS
from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult, Severity
from ..view import Val
from ._base import _found, _na, _pass, _rule, _settled, _violation


@_rule("MX001", "mxfp8 param gather needs buffer reuse")
def _mx001(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    recipe, fpg, reuse = ctx.fp8_recipe(), ctx.ddp("fp8_param_gather"), ctx.reuse()
    if not (recipe.known and fpg.known):
        unknown = recipe if not recipe.known else fpg
        return _na(rule, f"{unknown.path} {ctx.why_unknown(unknown)}", unknown.path)
    if recipe.value != "mxfp8" or not fpg.value:
        return _pass(rule, "not an MXFP8 param-gather config", recipe.path, recipe.value)
    if ctx.fsdp().known and ctx.fsdp().value:
        return _pass(rule, "Megatron-FSDP gathers params itself", ctx.fsdp().path, True)
    # Bridge asserts reuse for MXFP8 param gather; without it core keeps a second param buffer.
    settled = _settled(rule, reuse, "reuse_grad_buf_for_mxfp8_param_ag", "reuse is on")
    if settled:
        return settled
    return _violation(
        rule,
        "error",
        reuse.path,
        reuse.value,
        f"fp8_recipe=mxfp8 with fp8_param_gather=true needs reuse_grad_buf_for_mxfp8_param_ag=true "
        f"(seen {_y(reuse.value)}): Megatron-Bridge asserts it (MixedPrecisionConfig.finalize "
        "in 0.3/0.4, "
        "ConfigContainer.validate from 0.5), and without it megatron-core keeps a second full "
        "param buffer",
        ctx.fix_reuse(True),
    )


@_rule("MX002", "reuse needs fp8_param_gather")
def _mx002(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    reuse, fpg = ctx.reuse(), ctx.ddp("fp8_param_gather")
    if not reuse.known:
        return _na(rule, f"reuse_grad_buf_for_mxfp8_param_ag {ctx.why_unknown(reuse)}", reuse.path)
    if not reuse.value:
        return _pass(rule, "reuse is off", reuse.path, reuse.value)
    # megatron-core asserts this pair in DistributedDataParallelConfig.__post_init__.
    settled = _settled(rule, fpg, "fp8_param_gather", "fp8_param_gather is on")
    if settled:
        return settled
    fix = (
        {"mixed_precision": {"fp8_param_gather": True}}
        if ctx.bridge_semantics and ctx.view.mp_present
        else {"ddp": {"fp8_param_gather": True}}
    )
    return _violation(
        rule,
        "error",
        fpg.path,
        fpg.value,
        f"reuse_grad_buf_for_mxfp8_param_ag=true ({reuse.path}) needs fp8_param_gather=true: "
        "megatron-core's DistributedDataParallelConfig.__post_init__ asserts 'Reuse grad buffer only "
        "when keeping params in MXFP8' (Bridge defers that check to its finalize())",
        fix,
    )


@_rule("MX003", "param gather needs the distributed optimizer")
def _mx003(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    dist, fsdp = ctx.ddp("use_distributed_optimizer"), ctx.fsdp()
    if fsdp.known and fsdp.value:
        return _pass(rule, "Megatron-FSDP shards params itself", fsdp.path, True)
    reuse, fpg = ctx.reuse_anywhere(), ctx.ddp("fp8_param_gather")
    wants = reuse or (fpg.known and bool(fpg.value))
    if not wants and fpg.known and ctx.reuse_state() is False:
        return _pass(rule, "no fp8 param gather and no reuse", fpg.path, fpg.value)
    if not wants:
        return _na(rule, f"fp8_param_gather / reuse {ctx.why_unknown(fpg)}", fpg.path)
    # Only the distributed optimizer re-quantizes the fp8 params and owns the shared buffer.
    settled = _settled(rule, dist, "use_distributed_optimizer", "distributed optimizer on")
    if settled:
        return settled
    why = (
        "the shared param/grad buffer exists only with the distributed optimizer, and the optimizer step "
        "calls _copy_main_params_to_param_buffer(), which only DistributedOptimizer has"
        if reuse
        else "Megatron-LM rejects '--fp8-param-gather' without it: fp8 params are updated by re-quantizing "
        "the distributed optimizer's main params; otherwise they never change"
    )
    knob = "reuse_grad_buf_for_mxfp8_param_ag" if reuse else "fp8_param_gather"
    return _violation(
        rule,
        "error",
        dist.path,
        dist.value,
        f"{knob}=true needs use_distributed_optimizer=true (seen {_y(dist.value)}): {why}",
        {
            "ddp": {"use_distributed_optimizer": True},
            "optimizer": {"use_distributed_optimizer": True},
        },
    )


@_rule("MX004", "reuse is not for Megatron-FSDP")
def _mx004(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    fsdp = ctx.fsdp()
    if fsdp.known and not fsdp.value:
        return _pass(rule, "Megatron-FSDP stated false", fsdp.path, False)
    if ctx.reuse_state() is False:
        return _pass(rule, "reuse off", fsdp.path, fsdp.value)
    if not fsdp.known:
        return _na(rule, f"use_megatron_fsdp {ctx.why_unknown(fsdp)}", fsdp.path)
    reuse = [v for v in (ctx.reuse(), ctx.opt("reuse_grad_buf_for_mxfp8_param_ag")) if v.known and v.value]
    if not reuse:
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config", fsdp.path)
    # FSDP has no shared param/grad buffer: reuse there is either switched off by Bridge (a
    # memory saving that does not happen) or a buffer nobody gathers (core raises from 0.18).
    if ctx.bridge_semantics:
        sev: Severity = "warning"
        why = (
            "Megatron-Bridge switches reuse off for Megatron-FSDP during validate(), so the memory saving "
            "asked for does not happen (and this plugin has nothing to do)"
        )
    else:
        sev = "error"
        why = (
            "Megatron-FSDP has no shared param/grad buffer; the distributed optimizer's reuse branch "
            "stages main params into a buffer FSDP never gathers (core >= 0.18 raises NotImplementedError)"
        )
    return _violation(
        rule,
        sev,
        fsdp.path,
        True,
        f"use_megatron_fsdp=true with reuse_grad_buf_for_mxfp8_param_ag=true ({reuse[0].path}): {why}",
        # Bridge ORs dist.use_megatron_fsdp into ddp's: both must be off to clear this.
        {"ddp": {"use_megatron_fsdp": False}, "dist": {"use_megatron_fsdp": False}}
        if ctx.bridge_semantics
        else {"ddp": {"use_megatron_fsdp": False}},
    )


def _disagree(rule: Rule, sev: Severity, lose: Val, win: Val, what: str, fix: Any) -> Finding:
    return Finding(
        rule.id,
        sev,
        lose.path,
        lose.value,
        f"{lose.path}={_y(lose.value)} disagrees with {win.path}={_y(win.value)}: {what}",
        fix,
    )


#: Knobs whose copy outside ``mixed_precision`` matters for MXFP8 even when this file states no
#: ``mixed_precision``: the base recipe's (Bridge recipes set one) still overwrites them.
_MXFP8_KNOBS = ("fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "fp8_recipe", "fp8", "fp8_param")


def _mp_overwrites(ctx: EffectiveConfig, rule: Rule) -> list[Finding]:
    """A knob written in ddp/optimizer/model that ``mixed_precision`` owns: Bridge's
    ``MixedPrecisionConfig.setup()`` copies its own value over it in ``runtime_config_update()``,
    so what is written there never reaches the job."""
    view, out = ctx.view, []
    for knob, sections in MP_OWNED_KNOBS.items():
        for sec in sections:
            written, mp = view.raw(sec, knob), view.mp(knob)
            if not written.known:
                continue
            if view.mp_present and mp.known:
                if mp.value == written.value:
                    continue  # the copy agrees: harmless
                fix: Any = (
                    {"mixed_precision": {knob: written.value}}
                    if not view.mp_name
                    else f"# delete {written.path}: mixed_precision={view.mp_name} sets it to "
                    f"{_y(mp.value)}\n# (or pick a mixed_precision recipe with the value you want)"
                )
                why = (
                    "Bridge copies mixed_precision onto the ddp/optimizer/model sections in "
                    "runtime_config_update(), so the value written here is silently replaced"
                )
                out.append(_disagree(rule, "error", written, mp, why, fix))
            elif knob in _MXFP8_KNOBS and not (view.mp_stated and not view.mp_present):
                # mixed_precision: null in the file removes the base's; otherwise the base's wins.
                src = "the base recipe's mixed_precision" + (
                    "" if view.mp_present else " (Bridge recipes set one, e.g. 'bf16_mixed')"
                )
                fix = (
                    {"mixed_precision": "bf16_with_mxfp8_mixed"}
                    if knob == "reuse_grad_buf_for_mxfp8_param_ag" and written.value
                    else {"mixed_precision": {knob: written.value}}
                )
                why = (
                    f"{written.path} is overwritten by {src} during runtime_config_update(); "
                    "set it through mixed_precision instead"
                )
                out.append(Finding(rule.id, "warning", written.path, written.value, why, fix))
    return out


def _comm_overlap_overwrites(ctx: EffectiveConfig, rule: Rule) -> list[Finding]:
    """An overlap knob written in ddp/optimizer while the job has a ``comm_overlap`` section:
    ``CommOverlapConfig.setup()`` copies its own value over it inside ``pretrain()``, so a written
    value that differs never reaches the job (the rules judge the value that does)."""
    out = []
    for sec, knob in ctx.COMM_OVERLAP_OWNS:
        written, co = ctx.view.raw(sec, knob), ctx.comm_overlap(knob)
        if not written.known or co is None or not co.known or co.value == written.value:
            continue
        source, _, note = co.path.partition(" ")
        why = (
            f"{written.path}={_y(written.value)} is overwritten by {source}={_y(co.value)}"
            f"{' ' + note if note else ''} inside "
            "pretrain() (CommOverlapConfig.setup copies comm_overlap's overlap knobs onto ddp and "
            f"optimizer), so the job runs with {_y(co.value)}; set comm_overlap.{knob} if you meant "
            f"{_y(written.value)}, or delete {written.path}"
        )
        out.append(
            Finding(
                rule.id, "warning", written.path, written.value, why, {"comm_overlap": {knob: written.value}}
            )
        )
    return out


def _copies_disagree(ctx: EffectiveConfig, rule: Rule) -> list[Finding]:
    """Knobs the DDP and the optimizer each hold a copy of, which nothing syncs outside Bridge."""
    out = []
    # reuse: with it on only in ddp the optimizer stages into the params and the gather collects
    # gradients; on only in the optimizer, it stages into a buffer the DDP never gathers.
    d, o = ctx.reuse(), ctx.opt("reuse_grad_buf_for_mxfp8_param_ag")
    if d.known and o.known and bool(d.value) != bool(o.value):
        why = (
            "with reuse on only in ddp the optimizer copies main params into the params (not the shared "
            "buffer) and the all-gather then collects gradients; with reuse on only in the optimizer the "
            "main params are staged into a buffer the DDP does not gather from"
        )
        out.append(_disagree(rule, "error", o, d, why, ctx.fix_reuse(bool(d.value))))
    # distributed optimizer: Bridge turns it on in both (a warning there); megatron-core alone
    # lays the DDP buffers out for one optimizer and builds the other (an error).
    view = ctx.view
    rd, ro = view.raw("ddp", "use_distributed_optimizer"), view.raw("optimizer", "use_distributed_optimizer")
    if rd.known and ro.known and bool(rd.value) != bool(ro.value):
        sev: Severity = "warning" if ctx.bridge_semantics else "error"
        what = (
            "Megatron-Bridge turns the distributed optimizer on in both sections; state it once, consistently"
            if ctx.bridge_semantics
            else "the DDP buffers are laid out for one optimizer and get_megatron_optimizer() builds "
            "the other"
        )
        lose = rd if not rd.value else ro
        both = {"ddp": {"use_distributed_optimizer": True}, "optimizer": {"use_distributed_optimizer": True}}
        out.append(_disagree(rule, sev, lose, ro if lose is rd else rd, what, both))
    out += _overlap_copies(ctx, rule)
    return out


def _overlap_copies(ctx: EffectiveConfig, rule: Rule) -> list[Finding]:
    """overlap_param_gather: with reuse, the optimizer's copy decides who stages main params."""
    od, oo = ctx.ddp("overlap_param_gather"), ctx.opt("overlap_param_gather")
    if not (od.known and oo.known and bool(od.value) != bool(oo.value) and ctx.reuse_anywhere()):
        return []
    fix = {"ddp": {"overlap_param_gather": True}, "optimizer": {"overlap_param_gather": True}}
    if oo.value:
        # The optimizer skips staging ("done by the training loop"), the loop stages only with
        # ddp's overlap on, and the synchronous gather after the step collects gradients.
        why = (
            "with reuse the optimizer then skips staging its main params ('done by the training loop'), "
            "the loop stages only when ddp.overlap_param_gather is on, and the synchronous all-gather "
            "after the step collects gradients into the weights"
        )
        return [_disagree(rule, "error", od, oo, why, fix)]
    why = (
        "the optimizer stages main params after every step and the training loop stages them "
        "again (Bridge 0.6 turns both on; earlier releases leave them as written)"
    )
    return [_disagree(rule, "warning", oo, od, why, fix)]


@_rule("MX005", "sections agree on shared knobs")
def _mx005(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    out = _mp_overwrites(ctx, rule) + _comm_overlap_overwrites(ctx, rule) if ctx.view.kind == "recipe" else []
    out += _copies_disagree(ctx, rule)
    if out:
        return _found(rule, out)
    # Vacuous for knobs nobody states: it vouches for the stated copies only.
    return _pass(rule, "no disagreement between the copies of a knob stated here")


@_rule("MX006", "overlap_param_gather prerequisites")
def _mx006(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    ov, fsdp = ctx.ddp("overlap_param_gather"), ctx.fsdp()
    if not ov.known:
        return _na(rule, f"overlap_param_gather {ctx.why_unknown(ov, 'ddp.overlap_param_gather')}", ov.path)
    if not ov.value:
        return _pass(rule, "overlap_param_gather stated false", ov.path, False)
    if fsdp.known and fsdp.value:
        return _pass(rule, "Megatron-FSDP", fsdp.path, True)
    # Megatron-LM rejects the overlap without both; megatron-core alone builds no overlap at all.
    out = []
    dist, ogr = ctx.ddp("use_distributed_optimizer"), ctx.ddp("overlap_grad_reduce")
    if dist.known and not dist.value:
        out.append(
            Finding(
                rule.id,
                "error",
                dist.path,
                dist.value,
                "overlap_param_gather=true needs use_distributed_optimizer=true: there is no param "
                "all-gather "
                "without it (megatron-core <= 0.16 never installs the forward pre-hooks; Megatron-LM rejects "
                "'--overlap-param-gather' without the distributed optimizer)",
                {
                    "ddp": {"use_distributed_optimizer": True},
                    "optimizer": {"use_distributed_optimizer": True},
                },
            )
        )
    if ogr.known and not ogr.value:
        out.append(
            Finding(
                rule.id,
                "error",
                ogr.path,
                ogr.value,
                "overlap_param_gather=true needs overlap_grad_reduce=true: Megatron-LM rejects it "
                "('--overlap-grad-reduce should be turned on when using --overlap-param-gather'); without it "
                "megatron-core puts each buffer in a single bucket, so the first forward pre-hook waits for "
                "the whole model's gather and nothing overlaps",
                {"ddp": {"overlap_grad_reduce": True}},
            )
        )
    if out:
        return _found(rule, out)
    if not (dist.known and ogr.known):
        return _na(rule, "use_distributed_optimizer / overlap_grad_reduce come from the base config", ov.path)
    return _pass(rule, "distributed optimizer and overlap_grad_reduce on", ov.path, True)


@_rule("MX007", "no optimizer-step param gather with reuse")
def _mx007(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    ws = ctx.opt("overlap_param_gather_with_optimizer_step")
    if ws.known and not ws.value:
        return _pass(rule, "overlap_param_gather_with_optimizer_step off", ws.path, ws.value)
    if ctx.reuse_state() is False:
        return _pass(rule, "reuse off", ws.path, ws.value)
    if not ws.known:
        return _na(rule, f"overlap_param_gather_with_optimizer_step {ctx.why_unknown(ws)}", ws.path)
    if not ctx.reuse_anywhere():
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config", ws.path)
    # The step-overlapped gather reads the shared buffer while the optimizer writes it.
    hazards = ctx.installed.hazards if ctx.installed is not None else None
    rejects = hazards.rejects_step_overlap_with_reuse if hazards is not None else None
    where = ctx.installed.describe() if ctx.installed is not None else "the installed release pair"
    if rejects:
        verdict = f"{where} rejects it at config time (ValueError in OptimizerConfig.__post_init__)"
    elif rejects is False:
        verdict = f"{where} accepts it without supporting it ({HAZARDS['MX007'].symptom})"
    else:
        verdict = (
            "megatron-core 0.19 rejects it at config time; earlier releases accept it without supporting it"
        )
    why = (
        "overlap_param_gather_with_optimizer_step=true is not supported with "
        f"reuse_grad_buf_for_mxfp8_param_ag: {verdict} ({HAZARDS['MX007'].reference})"
    )
    fix = {"optimizer": {"overlap_param_gather_with_optimizer_step": False}}
    if ws.path.startswith("comm_overlap."):
        fix = {"comm_overlap": {"overlap_param_gather_with_optimizer_step": False}}
    return _violation(rule, "error", ws.path, True, why, fix)


_MX012_WHY = (
    "fp8_recipe=mxfp8 without fp8_param_gather keeps bf16 params plus MXFP8 copies "
    "(megatron-core warns of significant extra memory); legal, and this plugin has nothing to do"
)


@_rule("MX012", "mxfp8 without fp8 param gather")
def _mx012(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    recipe, fpg = ctx.fp8_recipe(), ctx.ddp("fp8_param_gather")
    if not recipe.known:
        return _na(rule, f"fp8_recipe {ctx.why_unknown(recipe)}", recipe.path)
    if recipe.value != "mxfp8":
        return _pass(rule, "not an mxfp8 recipe", recipe.path, recipe.value)
    # Legal, but bf16 params plus MXFP8 copies: the memory MXFP8 params were meant to save.
    settled = _settled(rule, fpg, "fp8_param_gather", "fp8_param_gather on")
    if settled:
        return settled
    return _violation(
        rule, "warning", fpg.path, False, _MX012_WHY, {"mixed_precision": "bf16_with_mxfp8_mixed"}
    )


@_rule("MX013", "MXFP8 knobs stated in the recipe")
def _mx013(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    if ctx.view.kind != "recipe":
        return _pass(rule, "complete config")
    if ctx.reuse_state() is False:
        return _pass(rule, "reuse off")
    if not ctx.reuse_anywhere():
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config")
    # A knob the base recipe decides is one the combination rules above could not judge.
    needed = {
        "ddp.use_distributed_optimizer": ctx.ddp("use_distributed_optimizer"),
        "ddp.overlap_param_gather": ctx.ddp("overlap_param_gather"),
        "ddp.overlap_grad_reduce": ctx.ddp("overlap_grad_reduce"),
        "optimizer.overlap_param_gather": ctx.opt("overlap_param_gather"),
    }
    missing = {k: v for k, v in needed.items() if not v.known and k not in ctx.view.invalid_paths}
    if not missing:
        return _pass(rule, "all stated")
    fix: dict[str, dict[str, bool]] = {}
    for k, v in missing.items():
        sec, knob = (v.path if v.path.startswith("comm_overlap.") else k).split(".")
        fix.setdefault(sec, {})[knob] = True
    why = "; ".join(f"{k} {ctx.why_unknown(v, k)}" for k, v in missing.items())
    return _violation(
        rule,
        "warning",
        ", ".join(missing),
        None,
        f"{why}; so the combination was not checked: state the value so that check can vouch for it",
        fix,
    )
