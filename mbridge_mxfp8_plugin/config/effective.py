"""The values the training job will run with: Bridge's precedence applied to a :class:`.view.ConfigView`.

Bridge does not use a written knob as is: ``mixed_precision`` owns the fp8 knobs (copied onto
ddp / optimizer / model in ``runtime_config_update``), ``comm_overlap`` overwrites the overlap
knobs with dp-size dependent defaults, either section turns the distributed optimizer on in both,
``dist.use_megatron_fsdp`` is ORed into ddp's. Every rule reads knobs through
:class:`EffectiveConfig`, so each of those facts lives in one method here, and an unknown value
carries the reason it is unknown (:meth:`EffectiveConfig.why_unknown`).
"""

from __future__ import annotations

from typing import Any

from ..common.yamltypes import yaml_literal
from ..probes.bridge_facts import MP_OWNED_KNOBS
from ..probes.stack import InstalledStack
from .view import UNKNOWN, ConfigView, Val

__all__ = ["EffectiveConfig"]


class EffectiveConfig:
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

    def comm_overlap_present(self) -> bool:
        """Whether the job has a ``comm_overlap`` section: stated here, or set by the base recipe
        (``check --recipe``, its source; the launcher, its built container). Where neither says,
        as without a recipe, the file is judged as the whole config: no section."""
        if not self.bridge_semantics:
            return False
        if "comm_overlap" in self.view.sections:
            return True
        base = self.view.base_recipe
        return base is not None and isinstance(getattr(base, "comm_overlap", None), dict)

    #: (section, knob) that ``CommOverlapConfig.setup`` overwrites when the section is present.
    COMM_OVERLAP_OWNS = (
        ("ddp", "overlap_grad_reduce"),
        ("ddp", "overlap_param_gather"),
        ("ddp", "bucket_size"),
        ("optimizer", "overlap_param_gather"),
        ("optimizer", "overlap_param_gather_with_optimizer_step"),
    )

    def comm_overlap(self, knob: str) -> Val | None:
        """The value ``comm_overlap`` gives ``knob`` (None: no section, the written value stands)."""
        return self._comm_overlap(knob)

    def _comm_overlap(self, knob: str) -> Val | None:
        """``comm_overlap.setup`` overwrites the overlap knobs of ddp and optimizer (Bridge)."""
        if not self.comm_overlap_present():
            return None
        v = self.view.raw("comm_overlap", knob)
        if v.known and v.value is not None:
            return v
        base = getattr(self.view.base_recipe, "comm_overlap", None)
        if "comm_overlap" not in self.view.sections and isinstance(base, dict):
            where = f"comm_overlap.{knob} (set by recipe {self.view.base_recipe.name})"
            if base.get(knob) is not None:
                return Val(base[knob], where)
            if "**" in base:  # CommOverlapConfig(**kwargs): this knob may be among them
                return Val(UNKNOWN, f"comm_overlap.{knob}")
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

    def model(self, knob: str) -> Val:
        """A model knob; ``mixed_precision`` owns the fp8 ones (Bridge). Unstated in the file, the
        value the named base recipe (``check --recipe``) assigns, when its source says."""
        owned = self._mp_owned("model", knob)
        if owned is not None:
            return owned
        written = self.view.raw("model", knob)
        base = self.view.base_recipe
        if written.known or base is None or knob not in base.model or written.path in self.view.base_refs:
            return written
        return Val(base.model[knob], f"model.{knob} (set by recipe {base.name})")

    def fp8_params(self) -> Val:
        """Params kept in FP8: ``fp8_param_gather`` (ddp) or the model's ``fp8_param``; the first
        one stated true, else the first stated, else unknown. Bridge's ``MixedPrecisionConfig``
        keeps the two equal, so there ``fp8_param_gather`` alone decides."""
        if self.bridge_semantics and self.view.mp_present:
            return self.ddp("fp8_param_gather")
        vals = (self.ddp("fp8_param_gather"), self.model("fp8_param"))
        for v in vals:
            if v.known and v.value:
                return v
        known = [v for v in vals if v.known]
        return known[0] if len(known) == len(vals) else Val(UNKNOWN, vals[0].path)

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

    def why_unknown(self, v: Val, where: str = "") -> str:
        """Why a knob's value is not known here: not stated, an interpolation into the base
        recipe, or stated (in ``where``) but overwritten by comm_overlap with a dp-size
        dependent default."""
        if v.path in self.view.invalid_paths or (where and where in self.view.invalid_paths):
            return "is written but rejected (see MX101/MX102), so its value is not judged here"
        if v.path in self.view.base_refs:
            expr = self.view.base_refs[v.path]
            if expr == "???":
                return "is ??? (the base recipe's value is kept)"
            return f"is {expr}, an interpolation into the base recipe"
        base_co = getattr(self.view.base_recipe, "comm_overlap", None)
        if v.path.startswith("comm_overlap.") and isinstance(base_co, dict) and "**" in base_co:
            return (
                f"is set by the base recipe's comm_overlap, built from **kwargs its source does not "
                f"spell out (state {v.path})"
            )
        if v.path.startswith("comm_overlap."):
            sec, _, knob = where.partition(".")
            stated = self.view.raw(sec, knob) if knob else Val(UNKNOWN, where)
            if stated.known:
                return (
                    f"is stated {yaml_literal(stated.value)}, but comm_overlap overwrites it with a "
                    f"default that depends on dp_size (pass --dp-size, or state {v.path})"
                )
            return f"is set by comm_overlap from dp_size (pass --dp-size, or state {v.path})"
        return "is not set in this recipe"

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

    def reuse_state(self) -> bool | None:
        """Reuse on (True), off in both the DDP and the optimizer (False), or decided by the base
        recipe (None): a rule may pass on "reuse off" only when it is known to be off."""
        vals = (self.reuse(), self.opt("reuse_grad_buf_for_mxfp8_param_ag"))
        if any(v.known and bool(v.value) for v in vals):
            return True
        return False if all(v.known for v in vals) else None

    def moe(self) -> tuple[bool | None, str]:
        """Whether the model has experts, and the evidence, written here or set by the named base
        recipe (``check --recipe``): ``num_moe_experts`` (what makes megatron-core build experts)
        or an expert parallel size above 1 (which core accepts only with experts). Another expert
        knob proves nothing: every GPT provider sets ``moe_router_topk``, dense ones included, so
        one set without ``num_moe_experts`` leaves the answer unknown (None), with that knob named."""
        experts = self.model("num_moe_experts")
        if experts.known and isinstance(experts.value, int) and experts.value > 0:
            return True, f"{experts.path}={experts.value}"
        ep = self.model("expert_model_parallel_size")
        if ep.known and isinstance(ep.value, int) and ep.value > 1:
            return True, f"{ep.path}={ep.value}"
        if experts.known:
            return False, f"{experts.path}={yaml_literal(experts.value)}"
        base = self.view.base_recipe.model if self.view.base_recipe is not None else {}
        stated = {**base, **self.view.sections.get("model", {})}
        # A parallel size of 1 or a knob turned off says nothing (dense recipes set them too).
        parallel = ("expert_model_parallel_size", "expert_tensor_parallel_size")
        knobs = sorted(
            k
            for k, v in stated.items()
            if (k.startswith("moe_") or "expert" in k) and k not in parallel and v not in (None, False)
        )
        if knobs:
            return None, (
                f"expert knob model.{knobs[0]} is set but num_moe_experts is not stated (dense "
                "providers set moe_router_topk too)"
            )
        return None, "neither this file nor a named base recipe says whether the model has experts"

    def model_int(self, knob: str, default: int) -> int:
        v = self.model(knob)
        return v.value if v.known and isinstance(v.value, int) else default

    def fix_reuse(self, value: bool) -> dict[str, Any]:
        key = "reuse_grad_buf_for_mxfp8_param_ag"
        if self.bridge_semantics and self.view.mp_present:
            if self.view.mp_name and value:
                return {"mixed_precision": "bf16_with_mxfp8_mixed"}
            return {"mixed_precision": {key: value}}
        return {"ddp": {key: value}, "optimizer": {key: value}}
