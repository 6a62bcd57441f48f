"""What every entry point does the same way: hold the options and the shared engine, log what the
engine's decision says (whether the plugin applies, who owns the sync: :mod:`..engine.applies`,
one rank-zero line either way), and check the job at train start.

Kept apart from the engine because it is about user-facing policy (what to log, what to refuse),
and apart from each adapter so that Bridge, Lightning and the loop API cannot drift.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from ..common.log import log_rank_zero
from ..config.validate import ValidationReport, validate_config
from ..engine.applies import Decision, decide
from ..engine.resume import ResumeRefresh
from ..engine.sync import ParamSyncEngine, SyncStats
from ..errors import MXFP8UsageError
from ..mcore.chunks import find_model_chunks
from ..mcore.layout import distributed_optimizers
from ..options import PluginOptions
from ..probes.owners import SyncOwner

if TYPE_CHECKING:  # pragma: no cover
    from ..verify import WeightReport

__all__ = [
    "HISTORY_LENGTH",
    "FromSession",
    "Session",
    "SessionFace",
    "bridge_resumed",
    "find_model_chunks",
    "validate_live_job",
]

_T = TypeVar("_T")

#: Events an entry point remembers in ``history`` (for logs and tests); older ones are dropped.
HISTORY_LENGTH = 1024


def bridge_resumed(context: Any) -> bool:
    """A Bridge callback context at train start of a job that loaded a checkpoint: Bridge's
    ``GlobalState.train_state.step`` is the loaded step there, 0 for a fresh job."""
    step = getattr(getattr(getattr(context, "state", None), "train_state", None), "step", 0)
    return isinstance(step, int) and step > 0


class Session:
    """What every entry point keeps, held by composition (``adapter.session``): its options, the
    shared engine of its model chunks (or why there is none), the last events with what they did,
    and the policies they share (binding, the train-start check, the verifier, the resume refresh).

    The adapters translate their framework's events into calls of these public methods and
    expose ``engine``, ``options``, ``last_report`` and the rest as attributes of their own
    (:class:`FromSession`), so a reader follows ``self.session.bind(...)`` into one place.
    """

    def __init__(
        self,
        framework: str,
        holder: str,
        options: PluginOptions | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        if options is not None and not isinstance(options, PluginOptions):
            raise MXFP8UsageError(
                f"{holder} takes a PluginOptions as its first argument, got "
                f"{type(options).__name__} (a recipe section: PluginOptions.from_mapping(section))"
            )
        #: the framework in log lines and report events; the adapter's class name in errors
        self.framework, self.holder = framework, holder
        # One options type for every entry point; a keyword given here wins over ``options``.
        self.options: PluginOptions = (options or PluginOptions()).replace(**(overrides or {}))
        self._disabled_logged = self._owner_logged = False
        self._unreadable_types_warned: set[str] = set()
        self.forget_engine()
        if self.options.verify_weights:
            # Triton's per-process start-up while the job builds its model, not at the
            # train-start warm-up where every rank waits (``verify.triton_startup``).
            from ..verify import triton_startup

            triton_startup.start()

    def forget_engine(self) -> None:
        """Drop the engine and everything learned about the chunks (a new job, an unpickled callback)."""
        self.engine: ParamSyncEngine | None = None
        #: what :meth:`verify` checks when the engine is not there (inactive, ``enabled=False``)
        self.verify_chunks: list[Any] | None = None
        self.verify_optimizer: Any = None
        self.last_report: WeightReport | None = None
        #: seconds the train-start warm-up of the weight check took (None: it did not run)
        self.prepared_s: float | None = None
        self.inactive_reason: str | None = None
        #: Megatron-FSDP / the LayerWise optimizer owns the param sync: passive, verifier included
        self.owner: SyncOwner | None = None
        self.model_key: tuple[int, ...] | None = None
        self.last_stats: SyncStats | None = None
        self.history: deque[tuple[str, SyncStats]] = deque(maxlen=HISTORY_LENGTH)
        #: armed by :meth:`loaded`, spent at the next step start (defect F)
        self.resume = ResumeRefresh()

    def disabled(self) -> bool:
        """``enabled=False``: no engine is built and no event does anything; said once."""
        if self.options.enabled:
            return False
        self.inactive_reason = "enabled=False"
        if not self._disabled_logged:
            self._disabled_logged = True
            log_rank_zero(
                logging.INFO, "MXFP8 param-sync plugin disabled (%s, enabled=False).", self.framework
            )
        return True

    def bind(
        self, chunks: Sequence[Any], optimizer: Any | None, *, reason: str | None = None
    ) -> ParamSyncEngine | None:
        """The shared engine of these chunks, prepared (offsets repaired); rebuilt only when the
        chunks change. ``reason``: the caller already knows the plugin does not apply."""
        self.remember(chunks, optimizer)
        key = ParamSyncEngine.model_key(chunks)
        if key == self.model_key:
            if self.engine is not None:
                self.engine.bind_optimizer(optimizer)
                if self.engine.owner is not None:  # the optimizer seen now owns the sync (LayerWise)
                    self.yield_to(self.engine.owner)
            return self.engine
        self.model_key = key
        # The owner is sticky: Bridge's on_checkpoint_save hands unwrapped modules, which show no
        # FSDP wrapper. ``reason`` (the caller's) stands unless an owner was found before.
        decision = (
            Decision(reason=reason)
            if reason and self.owner is None
            else decide(chunks, optimizer, owner=self.owner)
        )
        self.engine = None
        if decision.owner is not None:
            self.yield_to(decision.owner)
            return None
        self.inactive_reason = decision.reason
        if self.inactive_reason:
            log_rank_zero(
                logging.INFO, "MXFP8 param-sync plugin inactive: %s; nothing to do.", self.inactive_reason
            )
            return None
        engine = self.engine = ParamSyncEngine.shared(chunks, optimizer, decision=decision)
        report = engine.prepare(repair_offsets=self.options.repair_alignment)
        log_rank_zero(
            logging.INFO,
            "MXFP8 param-sync plugin active (%s, %d chunk(s)): %s; core forced-sync write-back=%s, "
            "dispatch reset=%s",
            self.framework,
            len(chunks),
            report.summary() if report else "no buckets",
            engine.behaviour.forced_sync_writes_back,
            engine.behaviour.has_dispatch_reset,
        )
        return engine

    def yield_to(self, owner: SyncOwner) -> None:
        """Someone else owns the param sync: no engine, and one line a default Bridge job shows."""
        self.engine, self.owner = None, owner
        self.inactive_reason = Decision.owned_by(owner).reason
        if not self._owner_logged:  # once per job: Bridge's save hands unwrapped modules (new key)
            self._owner_logged = True
            log_rank_zero(logging.WARNING, "%s", owner.message())

    def check_job(self, engine: ParamSyncEngine, container: Any = None) -> None:
        """Refuse at train start what would otherwise fail (or train wrong) at the first eval."""
        if engine.optimizer is not None and not distributed_optimizers(engine.optimizer):
            raise MXFP8UsageError(
                f"the optimizer handed to {self.holder} is {type(engine.optimizer).__name__}, "
                "which holds no megatron-core DistributedOptimizer: with "
                "reuse_grad_buf_for_mxfp8_param_ag the fp32 main params live only there. Build it with "
                "megatron.core.optimizer.get_megatron_optimizer and "
                "OptimizerConfig(use_distributed_optimizer=True)"
            )
        if not self.options.validate:
            return
        report = validate_live_job(
            engine.model_chunks, engine.optimizer, container=container, options=self.options
        )
        if report is not None and not report.ok:
            # ERROR, not WARNING: the job trains on weights these rules say are wrong (_log.py).
            log_rank_zero(logging.ERROR, "MXFP8 config problems (strict=False):\n%s", report.format_errors())

    def eval_starts(self, engine: ParamSyncEngine, event: str, *, gathered_fresh: bool | None) -> None:
        """Eval or test reads the weights next (``gathered_fresh`` as in ``before_eval``)."""
        if engine.optimizer is None:
            # validate()/test() without training: param.data is what was initialised or loaded and
            # the shared buffer holds no params; the engine keeps the pre-hooks from gathering it.
            log_rank_zero(
                logging.INFO,
                "MXFP8 param-sync plugin: %s without an optimizer; keeping weights as loaded.",
                event,
            )
        self.record(event, engine.before_eval(gathered_fresh=gathered_fresh))

    def remember(self, chunks: Sequence[Any] | None, optimizer: Any | None) -> None:
        # Only megatron-core DDP chunks count: Bridge's on_checkpoint_save passes the unwrapped
        # modules, which the verifier cannot read shards from.
        found = find_model_chunks([chunks])[0] if chunks is not None else []
        if found:
            self.verify_chunks = found
        if optimizer is not None:
            self.verify_optimizer = optimizer

    def _warn_unreadable_types(self, report: WeightReport) -> None:
        """One rank-0 warning per MXFP8 type the check cannot read, the first time it is seen."""
        for name in report.unchecked_types:
            if name not in self._unreadable_types_warned:
                self._unreadable_types_warned.add(name)
                log_rank_zero(
                    logging.WARNING,
                    "MXFP8 weight check: params of type %s cannot be read (%s); their checks say NOT "
                    "CHECKED%s. docs/verify.md names the types the check reads.",
                    name,
                    next((u for u in report.unchecked), "no reason given"),
                    " (accepted: verify_accept_unchecked)" if report.accept_unchecked else ", a failure",
                )

    def verify(
        self,
        event: str,
        model_chunks: Sequence[Any] | None = None,
        optimizer: Any | None = None,
        *,
        when: bool = True,
        force: bool = False,
    ) -> WeightReport | None:
        """The ``verify_weights`` policy every entry point shares: check the weights at ``event``
        on every rank. Returns the report, or None when the option is off (and not ``force``) or
        there is nothing to check yet (no model chunks or distributed optimizer seen).

        Adapters call it right after they handled an event at which the weights must equal the
        quantized fp32 main params: a forced sync (eval, test, save), a checkpoint load, train
        end. ``model_chunks``/``optimizer`` are remembered for later events whose context lacks
        them (Bridge's eval context has no optimizer); ``when=False`` only remembers. It runs
        with ``enabled=False`` too: it only reads, and a plugin switched off is what it guards.
        A mismatch raises :class:`~mbridge_mxfp8_plugin.MXFP8PluginError` with ``strict``, else is
        logged at ERROR on rank zero; every rank of a data-parallel group learns of a peer's
        mismatch through the check's all-reduce, so they raise together.
        """
        if not (self.options.verify_weights or force) or self.owner is not None:
            return None  # (an owner's weights follow its own gather, not the DistributedOptimizer's)
        self.remember(model_chunks, optimizer)
        if not when:
            return None
        report = self._check(f"{event} ({self.framework})")
        if report is None:
            return None
        self.last_report = report
        self._warn_unreadable_types(report)
        if report.ok:
            log_rank_zero(logging.DEBUG, "%s", report.message())
            return report
        if self.options.strict:
            report.raise_if_bad()
        log_rank_zero(logging.ERROR, "%s (strict=False: training goes on)", report.message())
        return report

    def _check(self, event: str) -> WeightReport | None:
        """One ``verify_weights`` call on what this session checks, or None where nothing can be
        checked yet (no model chunks or distributed optimizer seen)."""
        engine = self.engine
        chunks = engine.model_chunks if engine is not None else self.verify_chunks
        opt = (engine.optimizer if engine is not None else None) or self.verify_optimizer
        if not chunks or opt is None or not distributed_optimizers(opt):
            return None
        from ..verify import verify_weights

        return verify_weights(
            chunks,
            opt,
            event=event,
            sample=self.options.verify_sample,
            accept_unchecked=self.options.verify_accept_unchecked,
        )

    def prepare_verify(self) -> None:
        """Train start: make the weight check's costly first call here, not at the first eval.

        A job's first check builds the plan (the walk, each type's probe, the fused kernel's
        compile), runs it eagerly and records it as a CUDA graph: several steady checks' worth,
        which at an eval would stall every rank. Made here, every later check is a replay. It is a
        real check of the weights as initialised or loaded, but no loop promises current weights
        at train start, so a verdict that is not ok is logged, never raised (the checks at eval,
        save and load judge). Every rank calls it at the same point: it joins the check's
        all-reduce."""
        if not self.options.verify_weights or self.owner is not None:
            return
        t0 = time.perf_counter()
        report = self._check(f"train start, warm-up ({self.framework})")
        if report is None:
            return
        self.prepared_s = time.perf_counter() - t0
        log_rank_zero(
            logging.INFO,
            "MXFP8 weight check prepared at train start in %.2f s (its plan, probes, kernel compile "
            "and, on a GPU, CUDA-graph recording)%s; the checks at evals and saves replay it",
            self.prepared_s,
            _startup_note(),
        )
        self._warn_unreadable_types(report)  # NOT CHECKED is said there, once per type
        if not report.ok and report.verdict != "not checked":
            log_rank_zero(
                logging.WARNING,
                "%s (at train start: logged only, the weights are judged at eval)",
                report.message(),
            )

    def loaded(self) -> None:
        """A checkpoint was loaded (where the verifier checks "checkpoint load"): the next step
        start re-derives the params from the loaded main params, unless the loop does (F)."""
        self.resume.loaded()

    def step_started(self, engine: ParamSyncEngine, event: str) -> None:
        """A training step starts: undo a forced sync's dispatch state (C), then, on the first
        step after a load, re-derive the params (F) - after, so the groups stay synced."""
        stats = engine.step_started()
        if stats.groups_reset:
            self.record(event, stats)
        self.first_step_after_load(engine)

    def first_step_after_load(self, engine: ParamSyncEngine | None) -> None:
        """A step starts: if it is the first after a load, re-derive the params once (F)."""
        stats = self.resume.before_first_step(engine)
        if stats is not None:
            self.record("resume", stats)

    def record(self, event: str, stats: SyncStats) -> None:
        self.last_stats = stats
        self.history.append((event, stats))


def _startup_note() -> str:
    """What Triton's background start-up (``verify.triton_startup``) took, for the warm-up's log
    line: empty where it did not run."""
    from ..verify import triton_startup

    done = triton_startup.state()
    if not done.started or done.seconds is None:
        return ""
    if done.error:
        return f"; Triton's start-up in the background failed ({done.error}), paid here instead"
    return (
        f"; Triton's start-up ran in the background since setup ({done.seconds:.2f} s, "
        f"{done.waited_s:.2f} s of it waited for)"
    )


class FromSession(Generic[_T]):
    """An adapter attribute that is its session's (``adapter.engine`` is ``adapter.session.engine``):
    the public face users and tests read stays on the adapter, the state lives in one place."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> FromSession[_T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.session, self.name)  # type: ignore[attr-defined]

    def __set__(self, obj: object, value: _T) -> None:
        setattr(obj.session, self.name, value)  # type: ignore[attr-defined]


class SessionFace:
    """The attributes an entry point shows of its :class:`Session` (``engine``, ``options``,
    ``last_report``, ...): declared once for the three adapters, which hold no other state of it
    and call the session's methods themselves. No behaviour lives here."""

    session: Session
    options: FromSession[PluginOptions] = FromSession()
    engine: FromSession[ParamSyncEngine | None] = FromSession()
    inactive_reason: FromSession[str | None] = FromSession()
    last_stats: FromSession[SyncStats | None] = FromSession()
    last_report: FromSession[WeightReport | None] = FromSession()
    history: FromSession[deque[tuple[str, SyncStats]]] = FromSession()


def validate_live_job(
    model_chunks: Sequence[Any],
    optimizer: Any,
    *,
    container: Any = None,
    options: PluginOptions | None = None,
) -> ValidationReport | None:
    """The config the job really runs with, not a file: the Bridge ``ConfigContainer`` when there
    is one, else the live megatron-core configs the chunks and the distributed optimizer use.

    Returns None when there is nothing megatron-core to check (no DDP chunks, no optimizer).
    ``options.strict`` raises :class:`~mbridge_mxfp8_plugin.MXFP8ConfigError` on rule errors.
    """
    import torch.distributed as dist

    options = options or PluginOptions()
    dp = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if container is not None and all(hasattr(container, a) for a in ("ddp", "optimizer")):
        return validate_config(container, plugin=options, strict=options.strict)
    ddp = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    opts = distributed_optimizers(optimizer) if optimizer is not None else []
    if ddp is None or not opts:
        return None
    chunk = model_chunks[0]
    group = getattr(chunk, "intra_dp_cp_group", None) or getattr(chunk, "dp_cp_group", None)
    if group is not None and hasattr(group, "size"):
        dp = group.size()
    return validate_config(
        ddp=ddp, optimizer=opts[0].config, plugin=options, dp_size=dp, strict=options.strict
    )
