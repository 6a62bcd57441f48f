"""What the plugin itself costs at each Bridge callback event of a real ``pretrain()``.

Counted from outside the plugin, so a test can assert "passive" without trusting the plugin's
own ``SyncStats``:

* **all-gathers**: megatron-core's param all-gather collectives (``param_and_grad_buffer``'s
  ``dist_all_gather_func`` and ``torch.distributed.all_gather``, read at call time), split by who
  issued them: inside one of the plugin's hooks (the plugin's) or anywhere else (the framework's:
  forced syncs, pre-hook gathers);
* **other collectives**: ``all_reduce`` / ``broadcast`` inside a plugin hook (the exit-save vote);
* **stagings**: fp32 main params copied into the param buffer inside a plugin hook, by core's
  ``_copy_main_params_to_param_buffer`` or by the plugin's own planned copy
  (``plan.StagePlans.stage``), one per optimizer;
* **writes**: every DDP param/grad buffer and every param whose bytes differ after the hook
  (bitwise, on subclass-free views): what any staging, write-back or zeroing leaves behind.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class EventCost:
    """One plugin hook call. ``framework_gathers``: param all-gathers the framework issued since
    the previous plugin hook returned (e.g. the forced sync right before ``on_eval_start``)."""

    event: str
    step: int
    all_gathers: int = 0
    other_collectives: int = 0
    stagings: int = 0
    writes: list[str] = field(default_factory=list)
    framework_gathers: int = 0

    @property
    def idle(self) -> bool:
        return not (self.all_gathers or self.other_collectives or self.stagings or self.writes)


def _tensors(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """Name -> every DDP buffer tensor and param of these chunks (views without the subclass)."""
    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(chunks):
        buffers = list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
        for b, buffer in enumerate(buffers):
            for kind in ("param_data", "grad_data"):
                t = getattr(buffer, kind, None)
                if t is not None:
                    out[f"chunk{c}.buffer{b}.{kind}"] = t
        for name, p in chunk.named_parameters():
            out[f"chunk{c}.{name}"] = p
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: a bf16 view of an fp32 grad buffer holds NaN patterns, and NaN != NaN.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _snapshot(chunks: list[Any]) -> dict[str, torch.Tensor]:
    with torch._C.DisableTorchFunctionSubclass():
        return {n: _bytes(t).clone() for n, t in _tensors(chunks).items()}


def _in_flight(chunks: list[Any]) -> set[int]:
    """Storages an asynchronous param all-gather may still be writing (overlap_param_gather): their
    bytes change under any hook, so a change there is not the hook's write. The plugin never stages
    into them either (``stage_main_params`` refuses while a gather is in flight)."""
    out: set[int] = set()
    for chunk in chunks:
        groups = list(getattr(chunk, "bucket_groups", [])) + list(
            getattr(chunk, "expert_parallel_bucket_groups", [])
        )
        for group in groups:
            if group.param_gather_handle is not None:
                out.update(b.param_data.untyped_storage().data_ptr() for b in group.buckets)
    return out


def _changed(chunks: list[Any], before: dict[str, torch.Tensor], busy: set[int]) -> list[str]:
    with torch._C.DisableTorchFunctionSubclass():
        now = _tensors(chunks)
        return [
            n
            for n, t in now.items()
            if t.untyped_storage().data_ptr() not in busy
            and (n not in before or not torch.equal(_bytes(t), before[n]))
        ]


class CostMeter:
    """Wraps one plugin callback's hooks and counts what happens inside each (see the module)."""

    def __init__(self) -> None:
        self.costs: list[EventCost] = []
        self._current: EventCost | None = None
        self._framework = 0
        self._staging_depth = 0
        self._chunks: list[Any] = []

    # -- what is counted ---------------------------------------------------------------------
    def _gather(self) -> None:
        if self._current is not None:
            self._current.all_gathers += 1
        else:
            self._framework += 1

    def _collective(self) -> None:
        if self._current is not None:
            self._current.other_collectives += 1

    def _staging(self) -> None:
        if self._current is not None and self._staging_depth == 1:
            self._current.stagings += 1

    # -- hooks -------------------------------------------------------------------------------
    def wrap(self, callback: Any) -> Any:
        """Replace every ``on_*`` hook of ``callback`` by a bound method (Bridge's ``CallbackManager``
        reads ``getattr(cb, event).__func__``)."""
        for name in dir(type(callback)):
            if name.startswith("on_") and callable(getattr(callback, name)):
                setattr(
                    callback, name, types.MethodType(self._wrapped(name, getattr(callback, name)), callback)
                )
        return callback

    def _wrapped(self, name: str, hook: Any) -> Any:
        def run(_callback: Any, ctx: Any) -> None:
            # DDP chunks own a ``buffers`` list (nn.Module's is a method); some contexts (Bridge's
            # on_checkpoint_save) carry unwrapped modules: the run's chunks from earlier hooks then.
            chunks = [
                c
                for c in (getattr(ctx, "model", None) or [])
                if isinstance(getattr(c, "buffers", None), list)
            ]
            self._chunks = chunks or self._chunks
            train_state = getattr(getattr(ctx, "state", None), "train_state", None)
            self.measure(name, int(getattr(train_state, "step", -1)), self._chunks, lambda: hook(ctx))

        return run

    def measure(self, event: str, step: int, chunks: list[Any], call: Any) -> Any:
        """Run ``call()`` as the plugin's ``event`` and record what it cost; returns its result."""
        cost = EventCost(event, step, framework_gathers=self._framework)
        self._framework = 0
        before, busy = _snapshot(chunks), _in_flight(chunks)
        self._current = cost
        try:
            out = call()
        finally:
            self._current = None
        cost.writes = _changed(chunks, before, busy | _in_flight(chunks))
        self.costs.append(cost)
        return out

    @contextlib.contextmanager
    def counting(self) -> Iterator[CostMeter]:
        """Instrument megatron-core's collectives and staging paths (reversible)."""
        import megatron.core.distributed.param_and_grad_buffer as pgb
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        from mbridge_mxfp8_plugin.engine import plan

        dist = torch.distributed
        saved: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, attr: str, before: Any) -> None:
            if not hasattr(owner, attr):
                return
            original = getattr(owner, attr)

            def counted(*args: Any, **kwargs: Any) -> Any:
                before()
                return original(*args, **kwargs)

            saved.append((owner, attr, original))
            setattr(owner, attr, counted)

        def staged(original: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self._staging_depth += 1
                try:
                    self._staging()
                    return original(*args, **kwargs)
                finally:
                    self._staging_depth -= 1

            return counted

        patch(pgb, "dist_all_gather_func", self._gather)
        patch(dist, "all_gather", self._gather)
        patch(dist, "all_reduce", self._collective)
        patch(dist, "broadcast", self._collective)
        for owner, attr in (
            (DistributedOptimizer, "_copy_main_params_to_param_buffer"),
            (plan.StagePlans, "stage"),
        ):
            original = getattr(owner, attr)
            saved.append((owner, attr, original))
            setattr(owner, attr, staged(original))
        try:
            yield self
        finally:
            for owner, attr, original in reversed(saved):
                setattr(owner, attr, original)


def per_event(costs: list[EventCost], what: str) -> dict[str, int]:
    """Hook name -> the sum of ``what`` (``all_gathers``, ``stagings``, ...) over its calls."""
    out: dict[str, int] = {}
    for c in costs:
        value = getattr(c, what)
        out[c.event] = out.get(c.event, 0) + (len(value) if isinstance(value, list) else value)
    return out
