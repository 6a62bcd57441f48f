"""The one defect table and the one hazard table, and which of them a probed stack has.

``doctor`` renders both tables, ``check`` quotes them (MX009 the defects; MX007 and MX014-MX016
the hazards), the README and docs cite them. A *defect* is what the plugin repairs; a *hazard* is
a known upstream failure around MXFP8 reuse that it cannot repair, so ``check`` and the
train-start check refuse the config and name the YAML that avoids it. Which ones a stack has is
decided here once, from behaviours probed elsewhere (:mod:`.probes`); this module imports nothing
of the package, so every layer may read it. The same defects in NeMo 2's terms (:data:`NEMO_LOOP`,
:data:`NEMO_TERMS`) sit here too, so ``doctor`` speaks to NeMo 2 users without a second table.
The docs' copies of the tables are rendered from this module by ``docs/render.py``.
"""

from __future__ import annotations

from typing import Protocol

from ..common.records import record

__all__ = [
    "DEFECTS",
    "HAZARDS",
    "TRAINING_DEFECTS",
    "CoreSide",
    "Defect",
    "Hazard",
    "HazardSide",
    "LoopStaging",
    "ResumeSide",
    "NEMO_LAST_RELEASE",
    "NEMO_LOOP",
    "NEMO_TERMS",
    "core_defects",
    "defects_present",
    "hazards_exposed",
]


@record
class Defect:
    """One upstream defect: what breaks, where, and which release fixed it."""

    id: str
    #: One line, user-facing: what goes wrong in a training run.
    symptom: str
    #: Where upstream (module and function) the defect lives.
    where: str
    #: The release (and PR) that fixed it upstream.
    fixed_in: str


DEFECTS: dict[str, Defect] = {
    d.id: d
    for d in (
        Defect(
            "A",
            "bucket param_to_index ignores the 64-element param padding: the MXFP8 copy-back after the "
            "all-gather hands params their neighbours' values",
            "megatron-core distributed/param_and_grad_buffer.py, _ParamAndGradBucket.__init__",
            "megatron-core 0.17.0 (#3007)",
        ),
        Defect(
            "B1",
            "a forced (synchronous) param all-gather before eval/save does not write the gathered weights "
            "into the params: eval and saves see the previous iteration's weights",
            "megatron-core distributed/param_and_grad_buffer.py, _ParamAndGradBucketGroup.start_param_sync",
            "megatron-core 0.18.0 (_post_param_sync, #4563)",
        ),
        Defect(
            "B2",
            "the training loop does not stage the fp32 main params before its forced all-gather: the "
            "shared buffer still holds gradients, which become the weights wherever core writes them back",
            "megatron-bridge training/train.py, the eval and save blocks of train()",
            "megatron-bridge 0.5.0 for evals (#3727), 0.6.0 for every forced sync "
            "(with megatron-core 0.19.0's prepare_model_params_for_param_sync)",
        ),
        Defect(
            "C",
            "param_gather_dispatched stays set after a forced sync: the next training step skips gather, "
            "copy-back and re-zeroing (polluted gradients, stale weights); hidden in the interleaved "
            "pipeline schedule with align_param_gather=True, which re-dispatches every gather each step",
            "megatron-core distributed/param_and_grad_buffer.py, finish_param_sync",
            "megatron-core 0.19.0 (reset_param_sync_dispatch_state, #5487)",
        ),
        Defect(
            "E",
            "eval-only jobs (skip_train) keep the forward pre-hooks on: the first eval forward gathers the "
            "never-staged shared buffer over the loaded weights",
            "megatron-bridge training/train.py and megatron-core's forward pre-hook",
            "not fixed upstream",
        ),
        Defect(
            "F",
            "a resume re-quantizes the MXFP8 params from the checkpoint's bf16 values, not from the fp32 "
            "main params (some block scales and the column-wise copy differ, at bit level); the first "
            "step after the load computes with them where the loop runs it with the pre-hooks off",
            "the checkpoint load (each param's copy_ quantizes the loaded bf16) and the loop's first "
            "step after it (Megatron-LM training.py, megatron-bridge training/train.py)",
            "megatron-bridge 0.6.0 (#5066, pre-hooks on after an MXFP8 resume); Megatron-LM main after "
            "core_v0.19.2 (#6666)",
        ),
    )
}


#: The defects every training run can hit, in table order (E needs an eval-only job, F a resume).
TRAINING_DEFECTS = ("A", "B1", "B2", "C")


# NeMo 2's loop (``nemo.lightning``: ``MegatronStrategy``, ``MegatronParallel``) meets the same
# defects at other places than Bridge's, and a NeMo 2 user reads the table in NeMo's terms. NeMo 2
# is frozen: its LLM stack ends with nemo_toolkit 2.7 (3.0 is NeMo Speech, without
# ``nemo.lightning`` or ``nemo.collections.llm``), so these facts cannot go stale and no NeMo
# release will fix what they describe.

#: Why NeMo 2 users keep the defects: one line, quoted by ``doctor`` and the docs.
NEMO_LAST_RELEASE = (
    "NeMo 2.7 is the last NeMo with the LLM stack (nemo.lightning, nemo.collections.llm); "
    "nemo_toolkit 3.0 is NeMo Speech. No NeMo release will fix these defects: a NeMo 2 job keeps "
    "them for as long as it runs on NeMo 2"
)

#: What NeMo 2's loop does at the points where Bridge's loop stages, forces a sync or toggles the
#: forward pre-hooks (question, NeMo 2.7's answer).
NEMO_LOOP: tuple[tuple[str, str], ...] = (
    (
        "stages the fp32 main params before a forward",
        "never (megatron-core leaves it to the loop with overlap_param_gather): every training step's "
        "pre-hook gathers the buffer zero_grad_buffer() has just cleared",
    ),
    (
        "forces a param sync",
        "only in MegatronStrategy.save_checkpoint -> MegatronParallel.force_param_sync() "
        "(start_param_sync(force_sync=True) on every chunk, when use_distributed_optimizer and "
        "overlap_param_gather are on): every checkpoint save",
    ),
    (
        "toggles the forward pre-hooks around validation",
        "never: the first validation forward's pre-hook gathers whatever the shared buffer holds "
        "(after an optimizer step: the gradients, not the weights)",
    ),
)

#: Each defect of :data:`DEFECTS` as a NeMo 2 job meets it.
NEMO_TERMS: dict[str, str] = {
    "A": "the same buckets under MegatronParallel: every param all-gather (each step's pre-hook, "
    "each save's force_param_sync) hands params their neighbours' values",
    "B1": "MegatronStrategy.save_checkpoint's force_param_sync() does not write the gathered weights "
    "into the params: the checkpoint holds the weights of the previous gather",
    "B2": "NeMo never stages the main params, neither before a step nor before a save's "
    "force_param_sync() nor before validation: MXFP8 weights are the gathered zeros from the first "
    "step on (the loss stays at ln(vocab)), and validation and saves see whatever the shared buffer "
    "holds instead of the weights",
    "C": "after a validation (its pre-hooks dispatched the gathers) or a save's force_param_sync() the "
    "bucket groups stay marked dispatched: the next training step skips its all-gather and runs on "
    "the weights the validation or the save left",
    "E": "trainer.validate() or trainer.test() with no fit before it: the first forward's pre-hook "
    "gathers the never-staged shared buffer over the initialised or loaded weights",
    "F": "NeMo keeps the pre-hooks on after a load, so the first step gathers whatever was staged: "
    "with the Lightning callback's staging (stage_for_nemo_steps) the loaded main params, which "
    "re-derives the params; without it nothing is staged at all (B2)",
}


class CoreSide(Protocol):
    """What the core-side verdicts need of a megatron-core probe
    (:class:`mbridge_mxfp8_plugin.probes.CoreBehaviour`); ``None``: not probed."""

    @property
    def pads_bucket_offsets(self) -> bool | None: ...

    @property
    def forced_sync_writes_back(self) -> bool: ...

    @property
    def has_dispatch_reset(self) -> bool: ...


class LoopStaging(Protocol):
    """What :func:`defects_present` needs to know about a training loop (e.g. the installed
    Megatron-Bridge's, :class:`mbridge_mxfp8_plugin.probes.BridgeLoopBehaviour`)."""

    @property
    def stages_before_eval(self) -> bool: ...

    @property
    def stages_before_every_forced_sync(self) -> bool: ...


class ResumeSide(Protocol):
    """What the F verdict needs of a resume probe
    (:class:`mbridge_mxfp8_plugin.probes.resume.ResumeBehaviour`)."""

    @property
    def loop_fixes_f(self) -> bool: ...


def core_defects(core: CoreSide | None) -> dict[str, bool | None]:
    """Core-side defect id (A, B1, C) -> present; ``None`` where it is unknown (no megatron-core,
    or a behaviour that was not probed): unknown is never reported as "none"."""
    if core is None:
        return dict.fromkeys(("A", "B1", "C"))
    fixed = {"A": core.pads_bucket_offsets, "B1": core.forced_sync_writes_back, "C": core.has_dispatch_reset}
    return {d: None if ok is None else not ok for d, ok in fixed.items()}


def defects_present(
    core: CoreSide | None, loop: LoopStaging | None, resume: ResumeSide | None = None
) -> dict[str, bool | None]:
    """Every defect of :data:`DEFECTS` -> present in this stack (``None``: unknown).

    B2 is the loop's: present unless the loop stages the main params before *every* forced sync
    (Bridge 0.6); a loop that stages before evals only (Bridge 0.5) still saves gathered
    gradients, and with no Bridge installed any hand-written loop is assumed not to stage. E is
    in no release's fix list: an eval-only job never stages. F is present unless the loop keeps
    the pre-hooks on for the first step after an MXFP8 resume or its loader re-derives the params;
    unknown when the resume side was not probed.
    """
    present: dict[str, bool | None] = dict(core_defects(core))
    present["B2"] = loop is None or not loop.stages_before_every_forced_sync
    present["E"] = True
    present["F"] = None if resume is None else not resume.loop_fixes_f
    return {d: present[d] for d in DEFECTS}


@record
class Hazard(Defect):
    """A known upstream failure with MXFP8 reuse that the plugin cannot repair: its ``id`` is the
    ``check`` rule that refuses it, ``fixed_in`` may name the release that rejects the config,
    ``reference`` the upstream issue or pull request, ``fix`` the YAML that avoids it."""

    title: str
    reference: str
    fix: str


_HAZARD_LIST = (
    Hazard(
        id="MX007",
        title="overlap_param_gather_with_optimizer_step with reuse",
        symptom="the first chained optimizer dispatches the param all-gather of the shared buffer "
        "inside the optimizer step, a path the reuse code does not support; megatron-core < 0.19 "
        "accepts the config without a word",
        where="megatron-core optimizer/optimizer.py, ChainedOptimizer.step_with_ready_grads",
        fixed_in="megatron-core 0.19.0 (ValueError at config time)",
        reference="megatron-core 0.19.0 rejects it in OptimizerConfig.__post_init__ (with the "
        "forced-sync fix of Megatron-LM #5236)",
        fix="optimizer:\n  overlap_param_gather_with_optimizer_step: false",
    ),
    Hazard(
        id="MX014",
        title="MoE + reuse without overlapped param gather",
        symptom="the dense and the expert distributed optimizer of one ChainedOptimizer share the "
        "model chunk's buffer; with overlap_param_gather=false each one's param sync zeroes it "
        "before the other staged its main params: expert weights become zeros, the loss NaN",
        where="megatron-core optimizer/optimizer.py, ChainedOptimizer.step_with_ready_grads",
        fixed_in="megatron-core 0.18.0",
        reference="Megatron-LM #4800 (deferred MXFP8 param sync in ChainedOptimizer."
        "step_with_ready_grads); the assertion of #2271 was reverted in #2901",
        fix="ddp:\n  overlap_param_gather: true\n  overlap_grad_reduce: true\noptimizer:\n"
        "  overlap_param_gather: true\n# or install megatron-core >= 0.18",
    ),
    Hazard(
        id="MX015",
        title="full-iteration CUDA graphs with MXFP8 reuse",
        symptom="the training loop skips staging the main params while the forward pre-hooks are "
        "off (the first iteration), but the captured graph replays its all-gather unconditionally: "
        "zero weights, zero grad norm and a wrong loss on the first graphed step",
        where="megatron-bridge training/train.py, the main-param copy before each step",
        fixed_in="Megatron-Bridge 0.5.0",
        reference="Megatron-Bridge #3076 (train.py stages when a full-iteration graph was captured)",
        fix="model:\n  cuda_graph_impl: none   # or transformer_engine with layer scopes\n"
        "# or install Megatron-Bridge >= 0.5",
    ),
    Hazard(
        id="MX016",
        title="FP8 params with optimizer CPU offload",
        symptom="optimizer_cpu_offload forces the precision-aware distributed-optimizer path, which "
        "leaves None where each FP8 param shard should be; HybridDeviceOptimizer's param groups "
        "reject it: crash at optimizer build ('optimizer can only optimize Tensors')",
        where="megatron-core optimizer/distrib_optimizer.py, the main-param groups under CPU offload",
        fixed_in="not fixed upstream",
        reference="Megatron-LM #5083 (open; feature request #2407, unmerged PR #2788); Megatron-LM's "
        "own arguments reject --optimizer-cpu-offload with --fp8-param-gather unless --fp8-recipe "
        "delayed",
        fix="optimizer:\n  optimizer_cpu_offload: false",
    ),
)
HAZARDS: dict[str, Hazard] = {h.id: h for h in _HAZARD_LIST}


class HazardSide(Protocol):
    """What :func:`hazards_exposed` needs of a probe
    (:class:`mbridge_mxfp8_plugin.probes.HazardBehaviour`); ``None``: not known."""

    @property
    def defers_chained_mxfp8_sync(self) -> bool | None: ...

    @property
    def rejects_step_overlap_with_reuse(self) -> bool | None: ...

    @property
    def cpu_offload_drops_fp8_params(self) -> bool | None: ...

    @property
    def stages_for_full_iteration_graph(self) -> bool | None: ...


def _negated(value: bool | None) -> bool | None:
    return None if value is None else not value


def hazards_exposed(probe: HazardSide | None) -> dict[str, bool | None]:
    """Every hazard of :data:`HAZARDS` -> this stack lets a config hit it silently (``None``:
    unknown). MX007 counts as not exposed where megatron-core rejects the config itself."""
    if probe is None:
        return dict.fromkeys(HAZARDS)
    return {
        "MX007": _negated(probe.rejects_step_overlap_with_reuse),
        "MX014": _negated(probe.defers_chained_mxfp8_sync),
        "MX015": _negated(probe.stages_for_full_iteration_graph),
        "MX016": probe.cpu_offload_drops_fp8_params,
    }
