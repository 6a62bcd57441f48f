"""Defect F: make a resumed run compute with the weights the uninterrupted run would have.

A checkpoint holds every MXFP8 weight dequantized to bf16; the load writes it back through the
param's own ``copy_``, which quantizes again. That round trip keeps the row-wise values but not
always the bytes (about 5% of 32-element blocks come back with a scale one exponent finer), and
the column-wise copy that the backward pass reads is then quantized from the dequantized
row-wise values instead of from bf16(main param). The two differ wherever an element is
E4M3-subnormal in its row block but not in its column block. An uninterrupted run quantizes each
param from bf16(main param), gathered through the shared buffer. The loaded fp32 main params are
exact (they come from the optimizer state), so re-deriving the params from them once, before the
first forward, makes the resumed run equal the uninterrupted one bit for bit.

Who needs it is decided by behaviour, at the first step start after a load:

* the forward pre-hooks are on: the loop stages the main params for that step and its first
  forward gathers and writes them through ``copy_`` (Megatron-Bridge since #5066, NeMo 2 with the
  Lightning callback's staging): nothing to do;
* a loaded checkpoint loader re-derives after the load itself (Megatron-LM #6666): nothing to do;
* otherwise (Bridge <= 0.5 and Megatron-LM's ``train()`` run the first step with the pre-hooks
  off, on the loaded params): stage the main shards, force one all-gather per bucket group and
  write the result through each param's ``copy_`` (the engine's refresh), once.

The refresh leaves the bucket groups marked synced; that step runs with the pre-hooks off and
its ``finish_grad_sync`` clears the mark, so the next step gathers as usual.
"""

from __future__ import annotations

from ..probes.resume import loop_rederives_after_load
from .sync import ParamSyncEngine, SyncStats

__all__ = ["ResumeRefresh", "rederive_after_load"]


class ResumeRefresh:
    """One per entry point: armed when it sees a checkpoint load, spent at the next step start."""

    def __init__(self) -> None:
        self.pending = False

    def loaded(self) -> None:
        """A checkpoint was loaded into the model and the optimizer; no step has run since."""
        self.pending = True

    def before_first_step(self, engine: ParamSyncEngine | None) -> SyncStats | None:
        """Call at a step start, before that step's forwards; acts at most once per load.
        None when no load is pending (the per-step cost: one attribute read)."""
        if not self.pending:
            return None
        self.pending = False
        if engine is None:
            return SyncStats(note="resume: plugin inactive")
        return rederive_after_load(engine)


def rederive_after_load(engine: ParamSyncEngine, *, prehooks_on: bool | None = None) -> SyncStats:
    """Re-derive every param from the loaded fp32 main params unless the loop's first forward
    does it (``prehooks_on``: the caller's knowledge, else read from the chunks)."""
    if not engine.active:
        return SyncStats(note="resume: inactive")
    if not engine.overlap:
        # Every optimizer step then gathers synchronously; the engine's refresh needs the
        # overlapped layout, so the first step after a load keeps the loaded params here.
        return SyncStats(note="resume: no overlap_param_gather, params kept as loaded")
    if engine.optimizer is None:
        return SyncStats(note="resume: no optimizer known, params kept as loaded")
    if loop_rederives_after_load():
        return SyncStats(note="resume: the checkpoint loader re-derived the params")
    if engine.forward_pre_hooks_enabled() if prehooks_on is None else prehooks_on:
        return SyncStats(note="resume: the first forward gathers the staged main params")
    engine.weights_fresh = False  # a load is not a step: nothing else clears the flag
    stats = engine.refresh_weights(gathered_fresh=False)
    # The step about to run changes the main params: what was just written is not what an eval
    # after it must read (the flag would make the next refresh skip).
    engine.weights_fresh = False
    stats.note = "resume: re-derived the params from the loaded main params"
    return stats
