"""Config rules for MXFP8 param gather with grad-buffer reuse, checked before any GPU is touched.

The combination this plugin repairs (``fp8_param_gather`` + ``reuse_grad_buf_for_mxfp8_param_ag``
+ ``overlap_param_gather`` + distributed optimizer) is spread over three config sections that
Megatron-Bridge partly syncs, partly overwrites and partly ignores, and megatron-core checks only
one pair of it (with an ``assert``). Most wrong combinations therefore do not fail: they train,
on gradients read as weights or with a knob silently reset. This module names every such problem
at once, with the knob path, the value seen and the YAML that fixes it.

Two layers:

* :func:`validate_config` - static rules on a recipe mapping, a Bridge ``ConfigContainer`` or
  megatron-core's config dataclasses (see :mod:`.config_view` for how each is read).
* :func:`check_bucket_alignment` - the runtime check on live buckets (re-exported from
  :mod:`.buckets`; defect A can only be seen on a built model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ._schema import MP_OWNED_KNOBS, PLUGIN_SECTION
from .buckets import AlignmentReport, check_bucket_alignment
from .config_view import UNKNOWN, ConfigView, Val, read_config
from .errors import MXFP8ConfigError
from .stack import InstalledStack

__all__ = [
    "RULES",
    "AlignmentReport",
    "ConfigValidationError",
    "Finding",
    "InstalledStack",
    "Rule",
    "RuleResult",
    "ValidationReport",
    "check_bucket_alignment",
    "validate_config",
    "validate_live_job",
]

Severity = Literal["error", "warning"]
Status = Literal["pass", "warn", "fail", "n/a"]


@dataclass(frozen=True)
class Rule:
    id: str
    title: str


@dataclass(frozen=True)
class Finding:
    """One violation: where (``knob``), what was seen (``value``), why (``message``), and the fix."""

    rule: str
    severity: Severity
    knob: str
    value: Any
    message: str
    fix: Any = None

    @property
    def fix_yaml(self) -> str:
        if self.fix is None:
            return ""
        if isinstance(self.fix, str):
            return self.fix
        return yaml.safe_dump(self.fix, default_flow_style=False, sort_keys=False).rstrip()

    def line(self) -> str:
        return f"{self.severity} {self.rule} {self.knob}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "knob": self.knob,
            "value": _jsonable(self.value),
            "message": self.message,
            "fix": self.fix_yaml,
        }


@dataclass
class RuleResult:
    rule: Rule
    status: Status
    findings: list[Finding] = field(default_factory=list)
    #: For pass / n/a: what was checked, or why the rule could not be evaluated.
    note: str = ""
    #: The knob the rule is about and the value seen (for the table even when it passes).
    knob: str = ""
    value: Any = UNKNOWN


@dataclass
class ValidationReport:
    """Every rule's verdict. ``ok`` is False when any rule failed (errors, not warnings)."""

    kind: str
    results: list[RuleResult]
    dp_size: int | None = None
    installed: str = ""

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def by_rule(self, rule_id: str) -> RuleResult:
        for r in self.results:
            if r.rule.id == rule_id:
                return r
        raise KeyError(rule_id)

    def format_errors(self) -> str:
        lines = [f"MXFP8 config check failed with {len(self.errors)} error(s):"]
        for f in self.errors:
            lines.append(f"  {f.line()}")
            if f.fix_yaml:
                lines.append("    fix:\n" + _indent(f.fix_yaml, 6))
        return "\n".join(lines)

    def format_table(self) -> str:
        """One row per rule (pass / warn / fail / n/a), then each finding with its YAML fix."""
        rows = [("RULE", "STATUS", "CHECK", "KNOB", "VALUE", "NOTE")]
        for r in self.results:
            knob = r.findings[0].knob if r.findings else r.knob
            value = r.findings[0].value if r.findings else r.value
            note = f"{len(r.findings)} finding(s) below" if r.findings else r.note
            status = r.status.upper() if r.status in ("fail", "warn") else r.status
            rows.append((r.rule.id, status, r.rule.title, _clip(knob or "-", 48), _short(value), note))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        out = [
            "  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
            for row in rows
        ]
        for r in self.results:
            for f in r.findings:
                out.append("")
                out.append(f.line())
                if f.fix_yaml:
                    out.append("  fix:\n" + _indent(f.fix_yaml, 4))
        out.append("")
        out.append(
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
            f"{'' if self.dp_size is None else f'; dp_size={self.dp_size}'}; {self.installed}"
        )
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "kind": self.kind,
            "dp_size": self.dp_size,
            "installed": self.installed,
            "rules": [
                {
                    "id": r.rule.id,
                    "title": r.rule.title,
                    "status": r.status,
                    "knob": r.knob,
                    "value": _jsonable(r.value),
                    "note": r.note,
                    "findings": [f.as_dict() for f in r.findings],
                }
                for r in self.results
            ],
        }


class ConfigValidationError(MXFP8ConfigError):
    """Raised by strict validation; ``.report`` holds every rule's verdict."""

    def __init__(self, report: ValidationReport) -> None:
        super().__init__(report.format_errors())
        self.report = report


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def _y(value: Any) -> str:
    """A value as the user wrote it in YAML (``true``, ``null``), not as Python prints it."""
    text = yaml.safe_dump(_jsonable(value), default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(value: Any) -> str:
    if value is UNKNOWN:
        return "-"
    return _clip(_y(value), 30)


def _jsonable(value: Any) -> Any:
    if value is UNKNOWN:
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


# --------------------------------------------------------------------------- effective values
class _Context:
    """The config as the training job will see it, after Bridge's own syncing."""

    def __init__(self, view: ConfigView, dp_size: int | None, installed: InstalledStack | None) -> None:
        self.view = view
        self.dp_size = dp_size
        self.installed = installed
        self.bridge_semantics = view.kind != "mcore"

    # -- helpers
    def _mp_owned(self, section: str, knob: str) -> Val | None:
        if self.bridge_semantics and self.view.mp_present and section in MP_OWNED_KNOBS.get(knob, ()):
            return self.view.mp(knob)
        return None

    def _comm_overlap(self, knob: str) -> Val | None:
        """``comm_overlap.setup`` overwrites the overlap knobs of ddp and optimizer (Bridge)."""
        if not self.bridge_semantics or "comm_overlap" not in self.view.sections:
            return None
        v = self.view.raw("comm_overlap", knob)
        if v.known and v.value is not None:
            return v
        if self.dp_size is None:
            return Val(UNKNOWN, f"comm_overlap.{knob}")
        defaults = {
            "overlap_grad_reduce": self.dp_size > 1,
            "overlap_param_gather": self.dp_size > 1,
            "overlap_param_gather_with_optimizer_step": False,
            "bucket_size": 128 * 1024 * 1024 if self.dp_size > 1 else None,
        }
        if knob in defaults:
            return Val(defaults[knob], f"comm_overlap.{knob} (default for dp_size={self.dp_size})")
        return None

    def ddp(self, knob: str) -> Val:
        owned = self._mp_owned("ddp", knob)
        if owned is not None:
            return owned
        if knob in ("overlap_grad_reduce", "overlap_param_gather", "bucket_size"):
            co = self._comm_overlap(knob)
            if co is not None:
                return co
        if knob == "use_distributed_optimizer":
            return self.distopt()
        return self.view.raw("ddp", knob)

    def opt(self, knob: str) -> Val:
        owned = self._mp_owned("optimizer", knob)
        if owned is not None:
            return owned
        if knob in ("overlap_param_gather", "overlap_param_gather_with_optimizer_step"):
            co = self._comm_overlap(knob)
            if co is not None:
                return co
        if knob == "use_distributed_optimizer" and self.bridge_semantics:
            return self.distopt()
        return self.view.raw("optimizer", knob)

    def distopt(self) -> Val:
        """Bridge turns the distributed optimizer on in both sections if either asks for it."""
        d, o = (
            self.view.raw("ddp", "use_distributed_optimizer"),
            self.view.raw("optimizer", "use_distributed_optimizer"),
        )
        if not self.bridge_semantics:
            return d
        for v in (d, o):
            if v.known and v.value:
                return v
        if d.known and o.known:
            return d
        return Val(UNKNOWN, d.path)

    def fsdp(self) -> Val:
        d = self.view.raw("ddp", "use_megatron_fsdp")
        if self.bridge_semantics:
            s = self.view.raw("dist", "use_megatron_fsdp")
            if s.known and s.value:
                return s
        return d

    def fp8_recipe(self) -> Val:
        if self.bridge_semantics and self.view.mp_present:
            return self.view.mp("fp8_recipe")
        for v in (self.view.raw("model", "fp8_recipe"), self.view.raw("optimizer", "fp8_recipe")):
            if v.known and v.value is not None:
                return v
        return self.view.raw("model", "fp8_recipe")

    def reuse(self) -> Val:
        """Reuse as the DDP buffers see it (what decides the shared buffer layout)."""
        return self.ddp("reuse_grad_buf_for_mxfp8_param_ag")

    def reuse_anywhere(self) -> bool:
        return any(
            v.known and bool(v.value) for v in (self.reuse(), self.opt("reuse_grad_buf_for_mxfp8_param_ag"))
        )

    def model_int(self, knob: str, default: int) -> int:
        v = self.view.raw("model", knob)
        return v.value if v.known and isinstance(v.value, int) else default

    def fix_reuse(self, value: bool) -> dict[str, Any]:
        key = "reuse_grad_buf_for_mxfp8_param_ag"
        if self.bridge_semantics and self.view.mp_present:
            if self.view.mp_name and value:
                return {"mixed_precision": "bf16_with_mxfp8_mixed"}
            return {"mixed_precision": {key: value}}
        return {"ddp": {key: value}, "optimizer": {key: value}}


# --------------------------------------------------------------------------- rules
RuleFn = Callable[[_Context], RuleResult]
_REGISTRY: list[tuple[Rule, RuleFn]] = []


def _rule(rule_id: str, title: str) -> Callable[[Callable[[_Context, Rule], RuleResult]], RuleFn]:
    def deco(fn: Callable[[_Context, Rule], RuleResult]) -> RuleFn:
        rule = Rule(rule_id, title)

        def run(ctx: _Context) -> RuleResult:
            return fn(ctx, rule)

        _REGISTRY.append((rule, run))
        return run

    return deco


def _pass(rule: Rule, note: str, knob: str = "", value: Any = UNKNOWN) -> RuleResult:
    return RuleResult(rule, "pass", note=note, knob=knob, value=value)


def _na(rule: Rule, note: str, knob: str = "") -> RuleResult:
    return RuleResult(rule, "n/a", note=note, knob=knob)


def _found(rule: Rule, findings: Iterable[Finding], knob: str = "", value: Any = UNKNOWN) -> RuleResult:
    fs = list(findings)
    status: Status = "fail" if any(f.severity == "error" for f in fs) else ("warn" if fs else "pass")
    return RuleResult(rule, status, fs, knob=knob, value=value)


def _violation(
    rule: Rule, severity: Severity, knob: str, value: Any, message: str, fix: Any = None
) -> RuleResult:
    """The common case: a rule that found exactly one problem."""
    return _found(rule, [Finding(rule.id, severity, knob, value, message, fix)])


def _input_rule(rule_id: str, title: str, ok_note: str) -> None:
    @_rule(rule_id, title)
    def check(ctx: _Context, rule: Rule) -> RuleResult:
        issues = [i for i in ctx.view.issues if i.rule == rule_id]
        if not issues:
            return _pass(rule, ok_note)
        return _found(rule, (Finding(rule_id, "error", i.knob, i.value, i.message, i.fix) for i in issues))


_input_rule("MX101", "known sections and keys", "every section and key exists")
_input_rule("MX102", "knob types", "every knob has the right type")
_input_rule("MX103", "mixed-precision recipe name", "mixed_precision names a Bridge recipe (or is not set)")


@_rule("MX001", "mxfp8 param gather needs buffer reuse")
def _mx001(ctx: _Context, rule: Rule) -> RuleResult:
    recipe, fpg, reuse = ctx.fp8_recipe(), ctx.ddp("fp8_param_gather"), ctx.reuse()
    if not (recipe.known and fpg.known):
        return _na(rule, "fp8_recipe / fp8_param_gather not set by this config", recipe.path)
    if recipe.value != "mxfp8" or not fpg.value:
        return _pass(rule, "not an MXFP8 param-gather config", recipe.path, recipe.value)
    if ctx.fsdp().known and ctx.fsdp().value:
        return _pass(rule, "Megatron-FSDP gathers params itself", ctx.fsdp().path, True)
    if not reuse.known:
        return _na(rule, "reuse_grad_buf_for_mxfp8_param_ag comes from the base config", reuse.path)
    if reuse.value:
        return _pass(rule, "reuse is on", reuse.path, True)
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
def _mx002(ctx: _Context, rule: Rule) -> RuleResult:
    reuse, fpg = ctx.reuse(), ctx.ddp("fp8_param_gather")
    if not reuse.known or not reuse.value:
        return _pass(rule, "reuse is off", reuse.path, reuse.value)
    if not fpg.known:
        return _na(rule, "fp8_param_gather comes from the base config", fpg.path)
    if fpg.value:
        return _pass(rule, "fp8_param_gather is on", fpg.path, True)
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
def _mx003(ctx: _Context, rule: Rule) -> RuleResult:
    dist, fsdp = ctx.ddp("use_distributed_optimizer"), ctx.fsdp()
    if fsdp.known and fsdp.value:
        return _pass(rule, "Megatron-FSDP shards params itself", fsdp.path, True)
    reuse, fpg = ctx.reuse_anywhere(), ctx.ddp("fp8_param_gather")
    wants = reuse or (fpg.known and bool(fpg.value))
    if not wants:
        return _pass(rule, "no fp8 param gather", fpg.path, fpg.value)
    if not dist.known:
        return _na(rule, "use_distributed_optimizer comes from the base config", dist.path)
    if dist.value:
        return _pass(rule, "distributed optimizer on", dist.path, True)
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
def _mx004(ctx: _Context, rule: Rule) -> RuleResult:
    fsdp = ctx.fsdp()
    if not fsdp.known or not fsdp.value:
        return _pass(rule, "Megatron-FSDP off", fsdp.path, fsdp.value)
    reuse = [v for v in (ctx.reuse(), ctx.opt("reuse_grad_buf_for_mxfp8_param_ag")) if v.known and v.value]
    if not reuse:
        return _pass(rule, "reuse off", fsdp.path, True)
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
        {"ddp": {"use_megatron_fsdp": False}},
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


@_rule("MX005", "sections agree on shared knobs")
def _mx005(ctx: _Context, rule: Rule) -> RuleResult:
    view, out = ctx.view, []
    mxfp8_knobs = ("fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "fp8_recipe", "fp8", "fp8_param")
    if view.kind == "recipe":  # Bridge's mixed_precision.setup() overwrites these sections
        for knob, sections in MP_OWNED_KNOBS.items():
            for sec in sections:
                written = view.raw(sec, knob)
                if not written.known:
                    continue
                mp = view.mp(knob)
                if view.mp_present and mp.known:
                    if mp.value != written.value:
                        out.append(
                            _disagree(
                                rule,
                                "error",
                                written,
                                mp,
                                "Bridge copies mixed_precision onto the ddp/optimizer/model sections in "
                                "runtime_config_update(), so the value written here is silently replaced",
                                {"mixed_precision": {knob: written.value}}
                                if not view.mp_name
                                else f"# delete {written.path}: mixed_precision={view.mp_name} sets it to "
                                f"{_y(mp.value)}\n# (or pick a mixed_precision recipe with the "
                                "value you want)",
                            )
                        )
                elif knob in mxfp8_knobs and not (view.mp_stated and not view.mp_present):
                    src = (
                        "the base recipe's mixed_precision"
                        if view.mp_present
                        else ("the base recipe's mixed_precision (Bridge recipes set one, e.g. 'bf16_mixed')")
                    )
                    out.append(
                        Finding(
                            rule.id,
                            "warning",
                            written.path,
                            written.value,
                            f"{written.path} is overwritten by {src} during runtime_config_update(); "
                            "set it through mixed_precision instead",
                            {"mixed_precision": "bf16_with_mxfp8_mixed"}
                            if knob == "reuse_grad_buf_for_mxfp8_param_ag" and written.value
                            else {"mixed_precision": {knob: written.value}},
                        )
                    )
    # reuse: DDP and optimizer must agree, or the optimizer writes where the DDP does not read.
    d, o = ctx.reuse(), ctx.opt("reuse_grad_buf_for_mxfp8_param_ag")
    if d.known and o.known and bool(d.value) != bool(o.value):
        out.append(
            _disagree(
                rule,
                "error",
                o,
                d,
                "with reuse on only in ddp the optimizer copies main params into the params (not the shared "
                "buffer) and the all-gather then collects gradients; with reuse on only in the optimizer the "
                "main params are staged into a buffer the DDP does not gather from",
                ctx.fix_reuse(bool(d.value)),
            )
        )
    # distributed optimizer: Bridge turns both on; megatron-core alone does not.
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
        out.append(
            _disagree(
                rule,
                sev,
                lose,
                ro if lose is rd else rd,
                what,
                {
                    "ddp": {"use_distributed_optimizer": True},
                    "optimizer": {"use_distributed_optimizer": True},
                },
            )
        )
    # overlap_param_gather: who stages the main params depends on the optimizer's copy.
    od, oo = ctx.ddp("overlap_param_gather"), ctx.opt("overlap_param_gather")
    if od.known and oo.known and bool(od.value) != bool(oo.value) and ctx.reuse_anywhere():
        fix = {"ddp": {"overlap_param_gather": True}, "optimizer": {"overlap_param_gather": True}}
        if oo.value:
            out.append(
                _disagree(
                    rule,
                    "error",
                    od,
                    oo,
                    "with reuse the optimizer then skips staging its main params ('done by the "
                    "training loop'), "
                    "the loop stages only when ddp.overlap_param_gather is on, and the synchronous "
                    "all-gather "
                    "after the step collects gradients into the weights",
                    fix,
                )
            )
        else:
            out.append(
                _disagree(
                    rule,
                    "warning",
                    oo,
                    od,
                    "the optimizer stages main params after every step and the training loop stages them "
                    "again (Bridge 0.6 turns both on; earlier releases leave them as written)",
                    fix,
                )
            )
    if out:
        return _found(rule, out)
    return _pass(rule, "ddp, optimizer and mixed_precision agree")


@_rule("MX006", "overlap_param_gather prerequisites")
def _mx006(ctx: _Context, rule: Rule) -> RuleResult:
    ov, fsdp = ctx.ddp("overlap_param_gather"), ctx.fsdp()
    if not ov.known or not ov.value:
        return _pass(rule, "overlap_param_gather off", ov.path, ov.value)
    if fsdp.known and fsdp.value:
        return _pass(rule, "Megatron-FSDP", fsdp.path, True)
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
def _mx007(ctx: _Context, rule: Rule) -> RuleResult:
    ws = ctx.opt("overlap_param_gather_with_optimizer_step")
    if not ws.known or not ws.value:
        return _pass(rule, "overlap_param_gather_with_optimizer_step off", ws.path, ws.value)
    if not ctx.reuse_anywhere():
        return _pass(rule, "reuse off", ws.path, True)
    return _violation(
        rule,
        "error",
        ws.path,
        True,
        "overlap_param_gather_with_optimizer_step=true is not supported with "
        "reuse_grad_buf_for_mxfp8_param_ag: megatron-core 0.19 rejects it (ValueError in "
        "OptimizerConfig); earlier releases accept it without supporting it",
        {"optimizer": {"overlap_param_gather_with_optimizer_step": False}},
    )


@_rule("MX008", "bucket padding for this dp_size")
def _mx008(ctx: _Context, rule: Rule) -> RuleResult:
    dp = ctx.dp_size
    dist = ctx.ddp("use_distributed_optimizer")
    if dp is None:
        return _na(rule, "pass --dp-size (or mxfp8_plugin.dp_size) to check DP padding", "dp_size")
    if dp < 1:
        return _violation(rule, "error", "dp_size", dp, f"dp_size must be >= 1, got {dp}")
    if not dist.known:
        return _na(rule, "use_distributed_optimizer comes from the base config", dist.path)
    if not dist.value:
        return _pass(rule, "no distributed optimizer: megatron-core does not pad", dist.path, False)
    out: list[Finding] = []
    tp, cp = ctx.model_int("tensor_model_parallel_size", 1), ctx.model_int("context_parallel_size", 1)
    ep = ctx.model_int("expert_model_parallel_size", 1)
    etp_v = ctx.view.raw("model", "expert_tensor_parallel_size")
    etp = etp_v.value if etp_v.known and isinstance(etp_v.value, int) else tp
    inst_v = ctx.ddp("num_distributed_optimizer_instances")
    inst = inst_v.value if inst_v.known and isinstance(inst_v.value, int) and inst_v.value > 0 else 1
    busbw_v = ctx.ddp("pad_buckets_for_high_nccl_busbw")
    busbw = bool(busbw_v.value) if busbw_v.known else False
    divisors = (128, 2**16) if busbw else (128,)
    dense_group = dp * cp
    notes = []
    if dense_group % inst:
        out.append(
            Finding(
                rule.id,
                "error",
                inst_v.path,
                inst,
                f"dp_size*cp={dense_group} is not divisible by num_distributed_optimizer_instances={inst}: "
                "megatron-core cannot split the data-parallel group into equal optimizer instances",
                {"ddp": {"num_distributed_optimizer_instances": 1}},
            )
        )
    else:
        div = math.lcm(dense_group // inst, *divisors)
        notes.append(
            f"dense bucket ends padded to lcm({dense_group // inst},{','.join(map(str, divisors))})={div}"
        )
        out.extend(_padding_waste(ctx, rule, div, dp, busbw_v.path))
    if ep > 1:
        if (dp * cp * tp) % (ep * etp):
            out.append(
                Finding(
                    rule.id,
                    "error",
                    "model.expert_model_parallel_size",
                    ep,
                    f"dp_size*cp*tp={dp * cp * tp} is not divisible by expert_model_parallel_size*"
                    f"expert_tensor_parallel_size={ep * etp}: there is no integral expert data-parallel "
                    "group (megatron-core's initialize_model_parallel fails), so expert buffers cannot "
                    "be sharded",
                    "# choose expert_model_parallel_size * expert_tensor_parallel_size dividing "
                    f"{dp * cp * tp}",
                )
            )
        else:
            edp = dp * cp * tp // (ep * etp)
            if edp % inst:
                out.append(
                    Finding(
                        rule.id,
                        "error",
                        inst_v.path,
                        inst,
                        f"expert data-parallel size {edp} is not divisible by "
                        f"num_distributed_optimizer_instances={inst}",
                        {"ddp": {"num_distributed_optimizer_instances": 1}},
                    )
                )
            else:
                ediv = math.lcm(edp // inst, *divisors)
                notes.append(f"expert bucket ends padded to {ediv} (expert DP {edp})")
    if out:
        return _found(rule, out, "dp_size", dp)
    return _pass(
        rule,
        "param starts padded to 64 elements; " + "; ".join(notes) + " (megatron-core pads itself)",
        "dp_size",
        dp,
    )


def _padding_waste(ctx: _Context, rule: Rule, div: int, dp: int, busbw_path: str) -> list[Finding]:
    """Padding megatron-core adds is correct by construction; only its size can hurt."""
    ogr, bucket = ctx.ddp("overlap_grad_reduce"), ctx.ddp("bucket_size")
    if ogr.known and not ogr.value:
        if bucket.known and bucket.value is not None:
            return [
                Finding(
                    rule.id,
                    "warning",
                    bucket.path,
                    bucket.value,
                    "bucket_size is ignored without overlap_grad_reduce (megatron-core uses one bucket "
                    "per buffer)",
                    {"ddp": {"bucket_size": None}},
                )
            ]
        return []
    size = bucket.value if bucket.known and isinstance(bucket.value, int) else max(40_000_000, 1_000_000 * dp)
    if (div - 1) / size <= 0.05:
        return []
    return [
        Finding(
            rule.id,
            "warning",
            busbw_path if div >= 2**16 else bucket.path,
            div,
            f"each bucket end is padded to a multiple of {div} elements, up to {div - 1} wasted per "
            f"{size}-element bucket ({100 * (div - 1) / size:.0f}%) in both the param and the grad buffer",
            {"ddp": {"pad_buckets_for_high_nccl_busbw": False}}
            if div >= 2**16
            else {"ddp": {"bucket_size": None}},
        )
    ]


def _relevant_defects(ctx: _Context) -> list[str]:
    if ctx.installed is None or ctx.installed.core is None:
        return []
    dist, ov = ctx.ddp("use_distributed_optimizer"), ctx.ddp("overlap_param_gather")
    if not ctx.reuse_anywhere() or not (dist.known and dist.value):
        return []
    overlap = ov.known and bool(ov.value)
    return [d for d in ctx.installed.defects if d == "A" or overlap]


@_rule("MX009", "plugin on where the installed release needs it")
def _mx009(ctx: _Context, rule: Rule) -> RuleResult:
    enabled = Val(ctx.view.plugin.get("enabled", True), f"{PLUGIN_SECTION}.enabled")
    if ctx.installed is None or ctx.installed.core is None:
        return _na(rule, "megatron-core not importable: cannot tell which defects are present", enabled.path)
    defects = _relevant_defects(ctx)
    if enabled.value:
        return _pass(rule, "plugin enabled", enabled.path, True)
    if not defects:
        return _pass(rule, "no defect of the installed release applies to this config", enabled.path, False)
    effects = {
        "A": "params whose predecessor's size is not a multiple of 64 receive their neighbour's values",
        "B1": "eval and checkpoints see the weights of the previous iteration",
        "C": "the step after each eval/save adds the staged weights to the gradients",
    }
    return _violation(
        rule,
        "error",
        enabled.path,
        False,
        f"the plugin is disabled but {ctx.installed.describe()} has defect(s) "
        f"{', '.join(defects)} for this config: " + "; ".join(effects[d] for d in defects),
        {PLUGIN_SECTION: {"enabled": True}},
    )


@_rule("MX010", "alignment repair where defect A is present")
def _mx010(ctx: _Context, rule: Rule) -> RuleResult:
    repair = Val(ctx.view.plugin.get("repair_alignment", True), f"{PLUGIN_SECTION}.repair_alignment")
    if not ctx.view.plugin.get("enabled", True):
        return _pass(rule, "plugin disabled (see MX009)", repair.path, repair.value)
    if repair.value:
        return _pass(rule, "repair on", repair.path, True)
    if ctx.installed is None or ctx.installed.core_pads_bucket_offsets is None:
        return _na(rule, "cannot tell whether the installed megatron-core has defect A", repair.path)
    if "A" not in _relevant_defects(ctx):
        return _pass(rule, "defect A absent or not relevant", repair.path, False)
    return _violation(
        rule,
        "error",
        repair.path,
        False,
        f"repair_alignment=false on {ctx.installed.describe()}: bucket offsets there ignore the "
        "64-element padding, so MXFP8ParamSyncCallback raises MXFP8AlignmentError at train start",
        {PLUGIN_SECTION: {"repair_alignment": True}},
    )


@_rule("MX011", "known-broken release pair")
def _mx011(ctx: _Context, rule: Rule) -> RuleResult:
    inst = ctx.installed
    if inst is None or inst.core is None or inst.bridge_calls_prepare is None:
        return _na(rule, "megatron-bridge or megatron-core not installed here")
    if not inst.bridge_calls_prepare or inst.core.has_prepare_for_param_sync:
        return _pass(rule, f"installed pair agrees on the param-sync API: {inst.describe()}")
    dist, ov, fsdp = ctx.ddp("use_distributed_optimizer"), ctx.ddp("overlap_param_gather"), ctx.fsdp()
    if not (dist.known and dist.value and ov.known and ov.value) or (fsdp.known and fsdp.value):
        return _pass(rule, "the loop never disables the pre-hooks for this config", ov.path, ov.value)
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


@_rule("MX012", "mxfp8 without fp8 param gather")
def _mx012(ctx: _Context, rule: Rule) -> RuleResult:
    recipe, fpg = ctx.fp8_recipe(), ctx.ddp("fp8_param_gather")
    if not (recipe.known and recipe.value == "mxfp8"):
        return _pass(rule, "not an mxfp8 recipe", recipe.path, recipe.value)
    if not fpg.known:
        return _na(rule, "fp8_param_gather comes from the base config", fpg.path)
    if fpg.value:
        return _pass(rule, "fp8_param_gather on", fpg.path, True)
    return _violation(
        rule,
        "warning",
        fpg.path,
        False,
        "fp8_recipe=mxfp8 without fp8_param_gather keeps bf16 params plus MXFP8 copies "
        "(megatron-core warns of significant extra memory); legal, and this plugin has nothing to do",
        {"mixed_precision": "bf16_with_mxfp8_mixed"},
    )


@_rule("MX013", "MXFP8 knobs stated in the recipe")
def _mx013(ctx: _Context, rule: Rule) -> RuleResult:
    if ctx.view.kind != "recipe":
        return _pass(rule, "complete config")
    if not ctx.reuse_anywhere():
        return _pass(rule, "reuse off")
    needed = {
        "ddp.use_distributed_optimizer": ctx.ddp("use_distributed_optimizer"),
        "ddp.overlap_param_gather": ctx.ddp("overlap_param_gather"),
        "ddp.overlap_grad_reduce": ctx.ddp("overlap_grad_reduce"),
        "optimizer.overlap_param_gather": ctx.opt("overlap_param_gather"),
    }
    missing = [k for k, v in needed.items() if not v.known and k not in ctx.view.invalid_paths]
    if not missing:
        return _pass(rule, "all stated")
    fix: dict[str, dict[str, bool]] = {}
    for k in missing:
        sec, knob = k.split(".")
        fix.setdefault(sec, {})[knob] = True
    return _violation(
        rule,
        "warning",
        ", ".join(missing),
        None,
        "not set in this recipe, so the value comes from the base recipe and was not checked; state "
        "it so that check can vouch for the combination",
        fix,
    )


RULES: tuple[Rule, ...] = tuple(sorted((r for r, _ in _REGISTRY), key=lambda r: r.id))


def validate_config(
    cfg: Any = None,
    *,
    ddp: Any = None,
    optimizer: Any = None,
    model: Any = None,
    plugin: Any = None,
    dp_size: int | None = None,
    strict: bool = True,
    installed: InstalledStack | None = None,
) -> ValidationReport:
    """Run every rule; with ``strict`` raise :class:`ConfigValidationError` listing all errors.

    ``cfg`` is a recipe mapping (a loaded YAML, ``mxfp8_plugin:`` section included), a
    Megatron-Bridge ``ConfigContainer``, or megatron-core configs as a tuple
    ``(ddp_config, optimizer_config[, transformer_config])``; the same objects can be given as
    ``ddp=`` / ``optimizer=`` / ``model=`` instead. ``plugin`` (mapping or PluginOptions) describes
    how the plugin will be configured when ``cfg`` carries no ``mxfp8_plugin`` section.
    ``dp_size`` enables the padding rule; ``installed`` replaces the probe of the installed
    release pair (for tests, or to check a config for another cluster).
    """
    view = read_config(cfg, ddp=ddp, optimizer=optimizer, model=model, plugin=plugin)
    stack = installed if installed is not None else InstalledStack.detect()
    dp = dp_size if dp_size is not None else view.data_parallel_size
    ctx = _Context(view, dp, stack)
    results = [fn(ctx) for _, fn in sorted(_REGISTRY, key=lambda item: item[0].id)]
    report = ValidationReport(kind=view.kind, results=results, dp_size=dp, installed=stack.describe())
    if strict and not report.ok:
        raise ConfigValidationError(report)
    return report


def validate_live_job(
    model_chunks: Any,
    optimizer: Any,
    *,
    container: Any = None,
    plugin: Any = None,
    strict: bool = True,
) -> ValidationReport | None:
    """The adapters' train-start check: the Bridge ``ConfigContainer`` when there is one, else the
    live megatron-core configs the chunks and the distributed optimizer actually run with.

    Returns None when there is nothing megatron-core to check (no DDP chunks, no optimizer).
    """
    import torch.distributed as dist

    from .sync import distributed_optimizers

    dp = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if container is not None and all(hasattr(container, a) for a in ("ddp", "optimizer")):
        return validate_config(container, plugin=plugin, strict=strict)
    ddp = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    opts = distributed_optimizers(optimizer) if optimizer is not None else []
    if ddp is None or not opts:
        return None
    chunk = model_chunks[0]
    group = getattr(chunk, "intra_dp_cp_group", None) or getattr(chunk, "dp_cp_group", None)
    if group is not None and hasattr(group, "size"):
        dp = group.size()
    return validate_config(ddp=ddp, optimizer=opts[0].config, plugin=plugin, dp_size=dp, strict=strict)
