"""The one defect table, and which of its defects a probed stack has.

``doctor`` renders this table, ``check`` (MX009) quotes it, the README and docs cite it. Which
defects are present is decided here once, from behaviours probed elsewhere
(:mod:`.probes`); this module imports nothing of the package, so every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFECTS",
    "TRAINING_DEFECTS",
    "CoreSide",
    "Defect",
    "LoopStaging",
    "core_defects",
    "defects_present",
]


@dataclass(frozen=True)
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
    )
}


#: The defects a training run (not an eval-only job) can hit, in table order.
TRAINING_DEFECTS = ("A", "B1", "B2", "C")


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


def core_defects(core: CoreSide | None) -> dict[str, bool | None]:
    """Core-side defect id (A, B1, C) -> present; ``None`` where it is unknown (no megatron-core,
    or a behaviour that was not probed): unknown is never reported as "none"."""
    if core is None:
        return dict.fromkeys(("A", "B1", "C"))
    fixed = {"A": core.pads_bucket_offsets, "B1": core.forced_sync_writes_back, "C": core.has_dispatch_reset}
    return {d: None if ok is None else not ok for d, ok in fixed.items()}


def defects_present(core: CoreSide | None, loop: LoopStaging | None) -> dict[str, bool | None]:
    """Every defect of :data:`DEFECTS` -> present in this stack (``None``: unknown).

    B2 is the loop's: present unless the loop stages the main params before *every* forced sync
    (Bridge 0.6); a loop that stages before evals only (Bridge 0.5) still saves gathered
    gradients, and with no Bridge installed any hand-written loop is assumed not to stage. E is
    in no release's fix list: an eval-only job never stages.
    """
    present: dict[str, bool | None] = dict(core_defects(core))
    present["B2"] = loop is None or not loop.stages_before_every_forced_sync
    present["E"] = True
    return {d: present[d] for d in DEFECTS}
