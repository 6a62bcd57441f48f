"""``ensure_weights_current``: the repair on demand, beside the engine's other users.

For readers of a live model between training steps (export, RL refit, a custom eval). It drives
the shared :class:`~mbridge_mxfp8_plugin.engine.sync.ParamSyncEngine` (it may gather and write the
params), which is why it lives here and not with the read-only check in
:mod:`~mbridge_mxfp8_plugin.verify`. Public as ``mbridge_mxfp8_plugin.ensure_weights_current``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ..mcore.chunks import model_chunks as _model_chunks
from ..mcore.layout import buffers, main_params
from .sync import ParamSyncEngine, SyncStats

__all__ = ["ensure_weights_current"]

#: first model chunk -> (ids of all chunks, version counters of their buffers and main shards,
#: the engine's refresh stamp) when ensure_weights_current last made the weights current. Keyed
#: by the chunk, not the engine: without an adapter nothing else keeps the shared engine alive
#: between calls.
_CURRENT_AT: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], tuple[int, ...], int]] = (
    weakref.WeakKeyDictionary()
)


def _versions(engine: ParamSyncEngine, optimizer: Any) -> tuple[int, ...]:
    """Version counters of every param/grad buffer and every fp32 main shard.

    Every training step bumps the buffers' counter (``zero_grad_buffer`` is an in-place op on
    them, and views share their base's counter); an optimizer step or checkpoint load through
    torch ops bumps the main shards'. Fused optimizers that write through raw pointers (apex/TE
    ``multi_tensor_applier``) do not, but their steps follow a ``zero_grad_buffer``. Reading the
    counters costs no kernel and no sync.
    """
    out: list[int] = []
    for ref in buffers(engine.model_chunks):
        for data in (ref.param_data, ref.grad_data):
            out.append(-1 if data is None else data._version)
    out.extend(m._version for m in main_params(optimizer))
    return tuple(out)


def ensure_weights_current(model_chunks: Sequence[Any] | Any, optimizer: Any) -> SyncStats:
    """Make the params equal the quantized fp32 main params now; do nothing where they already do.

    For readers of a live model between training steps (export, RL refit, a custom eval): after
    an optimizer step, with reuse, the params hold the previous step's weights until the next
    forward gathers. Call on every rank at the same point (it may issue the param all-gathers).
    Uses the model's shared :class:`~mbridge_mxfp8_plugin.engine.sync.ParamSyncEngine`, so it
    cooperates with the plugin's callbacks and API.

    Nothing is done (no collective, no write) when:

    * the job is not in the affected mode (no MXFP8 reuse, or no ``overlap_param_gather``: the
      optimizer step then gathers synchronously);
    * this function made them current last and no param/grad buffer or main shard has changed
      since (their version counters: every training step zeroes the buffers in place), or the
      plugin's engine refreshed them and no step has started since (its adapters clear the
      engine's flag in ``step_started``), also when this function had made them current
      before that refresh;
    * the loop's last forced sync gathered freshly staged main params and core wrote them back
      (Megatron-Bridge >= 0.6 on megatron-core >= 0.19, judged by behaviour: core offers
      ``prepare_model_params_for_param_sync``, writes forced gathers back and resets the
      dispatch state, the live loop calls it, and every bucket group looks just synced).

    Otherwise it stages the main shards, forces one all-gather per bucket group and, on core
    < 0.18 (no write-back), copies the result into the params at the padded offsets and
    re-zeroes the shared buffer. Like the engine's refresh it leaves the bucket groups marked
    synced, so pre-hooks that stay on do not gather over the weights; on core < 0.19 the next
    training step must begin with the plugin's ``step_started`` (its callbacks and
    :func:`~mbridge_mxfp8_plugin.mxfp8_param_sync` do that) or it would skip its gather (C).
    """
    chunks = _model_chunks(model_chunks)
    engine = ParamSyncEngine.shared(chunks, optimizer)
    if not engine.active:
        return SyncStats(note="inactive: not MXFP8 params reusing the grad buffer")
    if not engine.overlap:
        return SyncStats(note="no overlap_param_gather: the optimizer step gathered already")
    if engine.alignment is None:
        engine.prepare()
    key = ParamSyncEngine.model_key(chunks)
    recorded = _CURRENT_AT.get(chunks[0])
    mine = recorded is not None and recorded[0] == key
    if mine and recorded is not None and recorded[1] == _versions(engine, optimizer):
        return SyncStats(note="weights already current (nothing changed since the last call)")
    if engine.weights_fresh and not (mine and recorded is not None and recorded[2] == engine.refresh_stamp):
        # An adapter refreshed after this function last did (or it never did); the adapter's
        # step_started clears the flag at the next step.
        return SyncStats(note="weights already current (refreshed by the plugin)")
    # The engine's flag is only as good as its step_started calls; the counters say a step ran.
    engine.weights_fresh = False
    engine.loop_stages_itself()
    stats = engine.refresh_weights(gathered_fresh=None)
    _CURRENT_AT[chunks[0]] = (key, _versions(engine, optimizer), engine.refresh_stamp)
    return stats
