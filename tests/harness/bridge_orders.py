"""Megatron-Bridge's releases, as the loop replica (:mod:`.bridge_loop`) tells them apart.

:class:`LoopOrder` lists what differs between the releases CI covers (0.3.1, 0.4.2, 0.5.1, 0.6.2)
around forced param syncs and callbacks, with references to each release's
``megatron/bridge/training/{train,eval,pretrain,checkpointing}.py``; :func:`loop_order` picks one by
name and :func:`replica_release` the one the replica holds a newer Bridge to.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LOOP", "LOOP_ORDERS", "LoopOrder", "loop_order", "replica_release"]


# ---------------------------------------------------------------------------------------------
# Loop orders. Line numbers: megatron/bridge/training/{train,eval,pretrain,checkpointing}.py of the
# release named; "0.3.1 L227" means train.py line 227 of megatron-bridge 0.3.1 unless a file is named.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopOrder:
    """What differs between Bridge releases around forced param syncs and callbacks."""

    release: str
    #: on_train_start fires before the initial ``disable_forward_pre_hook(param_sync=False)``
    #: (0.4.2 L266 vs L282; 0.5.1 L323/L339; 0.6.2 L349/L368) instead of after it (0.3.1 L227/L270).
    on_train_start_before_disable: bool
    #: eval interval read from ``cfg.validation`` (0.4+: ``val_config = config.validation``,
    #: 0.4.2 L130) instead of ``cfg.train`` (0.3.1 L503).
    validation_config: bool
    #: 0.5.1 L646-653: before the eval's forced sync, ``zero_grad_buffer()`` on every chunk and
    #: ``_copy_main_params_to_param_buffer()`` on every DistributedOptimizer (evals only).
    stage_before_eval: bool
    #: 0.6.2 L1145-1173: ``disable_forward_pre_hook(model, optimizer=...)`` and
    #: ``force_param_sync(model, optimizer=...)`` call ``optimizer.prepare_model_params_for_param_sync()``
    #: first: evals (L669), saves (L1321), weight-hash checks (L1087), the closing disable (L777).
    optimizer_prepares_sync: bool
    #: 0.6.2 eval.py: on_eval_start after ``model.eval()`` (L109/L111) and on_eval_end before
    #: ``model.train()`` (L371/L384), both inside ``evaluate()``; earlier releases fire them in
    #: ``evaluate_and_print_results`` around the ``evaluate()`` call (0.3.1 eval.py L320/L377).
    eval_events_inside_evaluate: bool
    #: on_checkpoint_save at the end of ``checkpointing.save_checkpoint`` (0.5.1 checkpointing.py
    #: L1243-1261, 0.6.2 L1548-1566), i.e. after the forced sync and the write.
    fires_on_checkpoint_save: bool
    #: 0.4+: the final save (last step not saved by the interval) is ``save_checkpoint_and_time`` inside
    #: ``train()`` before the closing disable (0.4.2 L606, 0.5.1 L742, 0.6.2 L757). 0.3.1 saves in
    #: pretrain.py L158 with ``save_checkpoint`` directly (no forced sync), after ``train()`` returned.
    final_save_in_train: bool
    #: 0.4+: ``save_checkpoint_and_time`` calls ``free_overlap_buffers()`` after the forced sync
    #: (0.4.2 L1143-1146).
    frees_overlap_buffers: bool


LOOP_ORDERS: dict[str, LoopOrder] = {
    "0.3.1": LoopOrder("0.3.1", False, False, False, False, False, False, False, False),
    "0.4.2": LoopOrder("0.4.2", True, True, False, False, False, False, True, True),
    "0.5.1": LoopOrder("0.5.1", True, True, True, False, False, True, True, True),
    "0.6.2": LoopOrder("0.6.2", True, True, False, True, True, True, True, True),
}
DEFAULT_LOOP = "0.3.1"


def loop_order(loop: str | LoopOrder | None = None) -> LoopOrder:
    """``"0.5.1"``, ``"0.5"`` (any 0.5.x) or a :class:`LoopOrder`; ``None`` is Bridge 0.3.1."""
    if isinstance(loop, LoopOrder):
        return loop
    key = (loop or DEFAULT_LOOP).strip().lstrip("v")
    if key in LOOP_ORDERS:
        return LOOP_ORDERS[key]
    minor = ".".join(key.split(".")[:2])
    for release, order in LOOP_ORDERS.items():
        if release.startswith(minor + "."):
            return order
    raise ValueError(
        f"unknown Megatron-Bridge loop order {loop!r}; known: {sorted(LOOP_ORDERS)} (or their X.Y)"
    )


def replica_release(installed: str) -> str:
    """The replica's order for an installed Bridge release: its own, or the newest the replica
    knows for a newer Bridge (main, 0.7.0-dev), which the callers then hold to that order."""
    newest = max(LOOP_ORDERS, key=lambda r: tuple(map(int, r.split("."))))
    minor = tuple(map(int, installed.split("+")[0].split(".")[:2]))
    return newest if minor > tuple(map(int, newest.split(".")[:2])) else installed
