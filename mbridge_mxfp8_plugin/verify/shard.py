"""The shard check: sampled blocks of every owned slice against their quantized main shard.

Per param, strided views at a full check or, sampled, a gather of its blocks at the plan's phase
(a device tensor: one plan and its captured graph serve every phase); reads, the reference write
and compares run once per batch of params of one type and configuration. The budget sizes the
batches: it bounds the check's memory, not the model. Verdicts stay on the device until one
read; only a failed batch is compared again, param by param, to name them. Beside it:
``sampling`` picks blocks, ``batches`` packs the plan, ``probe`` settles what each batch key may
do, ``graphs`` and ``_templates`` the captures. Here: a call's order, the three compare paths
(values, bytes, the fused kernel), attribution, the report.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from . import batches, fused, graphs
from ._attribute import Attribution
from ._flags import new_flags, stack_verdicts
from ._templates import Template, capture_all, plan_templates, replay_all
from .batches import Batch, Item, Owned, Slot, at_phase, got_bytes, main_rows, pack, sides
from .probe import Probed, Refused, why_type
from .read import Reader
from .reference import PROBE_ROWS, self_check
from .report import WeightReport
from .sampling import Phase

__all__ = ["ShardCheck"]

#: A batch's one launch (``fused``), or None where its items keep the per-item path.
_Launch = fused.Launch | fused.ValuesLaunch | fused.GatherLaunch | None
#: Phases whose eager batches (views only) a plan keeps: every phase of the default sample.
_KEPT_PHASES = 64


class ShardCheck:
    """The shard check of one ``verify_weights`` call, and its plan for the next ones.

    ``add`` only plans (views of the params and main shards); ``finish`` reads and compares. A
    later call over the same tensors reuses the plan (``restart``) at any sampled phase (data:
    ``self.phase``), so blocks, readers, batch keys and capacities are worked out once per plan,
    and its captured graph replays for every phase."""

    def __init__(
        self,
        report: WeightReport,
        atol: float,
        stride: int,
        offset: int,
        budget_bytes: int,
        probed: Probed | None = None,
    ):
        self.report, self.atol, self.stride, self.budget = report, atol, stride, budget_bytes
        self.phase = Phase(stride, offset)
        self.probed = probed = probed or Probed()
        self.capacity = probed.capacity  # batch key -> blocks per batch
        self.empty: dict[tuple[Any, ...], int] = {}  # batch key -> params with no block to compare
        self.batches: dict[tuple[Any, ...], Batch] = {}
        self.slots: list[Slot] = []
        self.references = probed.references
        self.refused = probed.refused  # batch key -> why its type cannot be checked
        self.trusted = probed.trusted  # keys whose reader passed the self-check
        self.fused = probed.fused  # keys whose type writes TE's bytes (see ``fused``)
        self.written = probed.written  # a fused key's blocks per write of the type (attribution)
        self._flags: torch.Tensor | None = None  # per call: differing bytes per fused batch
        self._flag_of: dict[int, int] = {}
        self._count_of: dict[int, int] = {}  # own-write batch -> its count in ``_flags``
        # batch -> its one launch in a capture (fused, values or own-write gathers; None: none)
        self._launches: dict[int, _Launch] = {}
        self._tabled = 0  # planned batches whose launches are made
        self.verdicts: list[tuple[Batch, torch.Tensor]] = []
        self.planned: list[Batch] = []  # sealed batches, in the order they are compared
        self.reusable = True  # False once a compare was refused (the plan is not kept)
        self.runs = 0  # finished calls of this plan
        self.graph: Any = None  # the compares captured as one CUDA graph (see ``_capture``)
        self.graph_verdicts: list[tuple[Batch, torch.Tensor]] = []  # never appended to: shared
        self.graph_stacked: torch.Tensor | None = None  # the graph's verdicts, one tensor
        self.templates: list[Template] = []  # own-write keys recorded once, replayed per batch
        self._tallies: dict[int, WeightReport] = {}  # phase -> what a replay of it checks
        self._per_phase: list[int] = []  # elements compared at each phase (``_count_every_phase``)
        self._dirty: set[int] = set()  # slots with differing elements counted this call
        self.attribute = Attribution(  # names a failed batch's params (the failure path only)
            self.slots, self._dirty, atol, self.budget, self.references, probed.written
        )
        self.no_graph = ""  # why the compares are not replayed from a graph
        self._capturing = False
        self._launched = False  # the graph was replayed for this call already (``launch``)
        self._eager: dict[tuple[int, int], Batch] = {}  # (batch, phase) -> its blocks at that phase

    def restart(self, report: WeightReport, offset: int) -> None:
        """Ready the same plan for another call at ``offset``'s phase (a launch left unread by a
        call that never finished is not this one's: ``finish`` replays)."""
        self._launched = False
        self.phase.set(offset)
        self.attach(report)

    def attach(self, report: WeightReport) -> None:
        """This call's report (it may have been launched before the report existed)."""
        self.report, self.verdicts = report, []
        for i in self._dirty:  # only the slots a failed batch counted (not every param, every call)
            self.slots[i].differing, self.slots[i].worst = 0, 0.0
        self._dirty.clear()

    def replayable(self) -> bool:
        return self.graph is not None

    def launch(self, offset: int) -> None:
        """Replay the graph at ``offset``'s phase as a call's first act (``attach``, then
        ``finish``): what the host does after it overlaps the compares."""
        self.phase.set(offset)
        self._replay()
        self._launched = True

    def _replay(self) -> None:
        self.graph.replay()
        replay_all(self.templates)
        self.phase.advance()  # behind what reads it: the next call's phase, off its critical path

    def abandon(self) -> None:
        """Forget a launched replay its call will not read, once done: its plan may be dropped next."""
        self._launched = False
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def add(self, name: str, param: Any, reader: Reader, own: Owned, mxfp8: bool) -> None:
        """Queue the sampled blocks of ``param``'s owned slice."""
        main = own.main
        assert main is not None
        if main.dim() != 1 or not main.is_contiguous():
            main = main.reshape(-1)
        s, e, buf = own.start, own.end, own.buffer_dtype
        # In reuse mode the main shard travels as bf16 (staged into the bf16 view of the grad
        # buffer); with a uint8 FP8 buffer it is cast from fp32 directly.
        round_to = buf if buf is not None and buf.is_floating_point and buf.itemsize >= 2 else None
        quantizer = getattr(param, "_quantizer", None)
        key = (mxfp8, type(param), param.dtype, round_to, type(quantizer), getattr(quantizer, "dtype", None),
               reader.kind)  # fmt: skip
        slot = len(self.slots)
        if mxfp8:
            blocks, whole = self.phase.slice(param, s, e)
            self.slots.append(Slot(name, 0, (e - s) - whole, mxfp8_type=type(param).__name__, sampled=blocks))
            item = Item(slot, reader, main, s, blocks, mxfp8_codes=reader.scales is not None)
        else:
            blocks, tail = self.phase.slice(None, s, e)
            views = (reader.flat[e - tail : e], main[e - s - tail : e - s]) if tail else None
            item = Item(slot, reader, main, s, blocks, views)
            self.slots.append(Slot(name, 0, 0, sampled=blocks, tail=tail))
        devices = {main.device, reader.flat.device}
        for device in devices:  # for the probe's blocks
            self.phase.reserve(device, min(blocks.count, PROBE_ROWS))
        if item.blocks.count == 0 and item.tail is None:
            self.empty[key] = self.empty.get(key, 0) + 1  # no whole block here: nothing to compare
            return
        cap = self.capacity.get(key) or self.probed.probe(key, param, item, round_to, self.budget)
        if key in self.refused:
            self.slots[slot].unchecked = self.refused[key]
            return
        if key not in self.fused:  # the fused kernel computes its indices itself
            for device in devices:
                self.phase.reserve(device, min(blocks.count, cap))

        def fresh() -> Batch:  # this param stands for the batch it opens
            return self.batches.setdefault(key, Batch(key, param, mxfp8, round_to))

        def full() -> Batch:  # sealed as soon as it fills: the compares run in that order
            self._seal(key)
            return fresh()

        pack(item, cap, self.batches.get(key) or fresh(), full)

    def _seal(self, key: tuple[Any, ...]) -> None:
        batch = self.batches.pop(key, None)
        if batch is not None and batch.items:
            self.planned.append(batch)

    def _flush_fused(self, batch: Batch) -> None:
        """TE's cast of the main blocks against the param's bytes: one launch for the batch
        (``fused.Launch``), or one per item where its items cannot share one. A batch it finds
        differing is judged again by the type's own write (``attribute``). A values batch with
        a ``fused.ValuesLaunch`` is one launch too, attributed on the gathers."""
        slot = self._flag_of[id(batch)]
        flags, rounding = self._flags, batch.round_to is not None
        assert flags is not None
        phase = self.phase.tensor(batch.items[0].main.device)
        one = self._launches.get(id(batch))
        if one is not None and not isinstance(one, fused.GatherLaunch):
            one(flags, slot, phase)
        else:
            for it in batch.items:
                fused.compare(it.main, -it.start, it.reader, it.blocks, rounding, flags, slot, phase)
        self.verdicts.append((batch, flags[slot]))

    def _plan_launches(self) -> None:
        """The batches' item tables, made once per plan before any run and sent in one copy."""
        if self._tabled == len(self.planned):  # a kept plan's are made: nothing per call
            return
        tables, made = fused.Tables(), dict[int, _Launch]()
        for batch in self.planned[self._tabled :]:
            one: _Launch
            if batch.key in self.fused:
                one = fused.launch(batch.items, batch.round_to is not None, tables)
            elif not batch.mxfp8 and batch.key not in self.refused:
                dtype = batch.param.dtype
                one = fused.values_launch(batch.items, batch.round_to, dtype, self.atol, tables)
            elif batch.items[0].mxfp8_codes and batch.key not in self.refused:
                one = fused.gather_launch(batch.items, batch.round_to, tables)
            else:
                continue
            made[id(batch)] = one
        if made and graphs.on_cuda(self.planned[0].items[0].main) and not graphs.refusal(self._write_paths()):
            self.templates = plan_templates(self.planned, made, tables)  # its tables still on the host
        tables.upload()  # before any launch is kept: none reads a table still on the host
        self._launches.update(made)
        self._tabled = len(self.planned)

    def _new_flags(self) -> None:
        """This call's zeroed counters and each batch's slot in them (``_flags``)."""
        self._flag_of, self._count_of, self._flags = new_flags(
            self.planned, self._launches, self.templates, self.fused, self.refused
        )

    def _flush_codes(self, batch: Batch) -> None:
        """Codes and scale bytes of the reference against the param's: equal bytes are equal
        values. A batch with differing bytes is compared by value in ``finish`` (a checkpoint
        load re-quantizes about 5% of blocks to other bytes with the same values). Captured, its
        gather and compare are a launch each where it has them (``fused.GatherLaunch``)."""
        one = self._launches.get(id(batch)) if self._capturing else None
        launch = one if isinstance(one, fused.GatherLaunch) else None
        phase = self.phase.tensor(batch.items[0].main.device)
        rows = main_rows(batch) if launch is None else launch(phase)
        codes, scales = self.references[batch.key].codes(rows, batch.blocks)
        del rows
        if launch is not None:
            slot = self._count_of.get(id(batch))
            count = self._flags[slot] if slot is not None and self._flags is not None else None
            self.verdicts.append((batch, launch.differing(codes, scales, phase, count)))
            return
        got_codes, got_scales = got_bytes(batch)
        self.verdicts.append((batch, batches.bytes_differ(codes, got_codes)))
        self.verdicts.append((batch, torch.ne(scales, got_scales).any()))

    def _compare(self, batch: Batch) -> None:
        """Compare one batch; the verdict stays on the device (no host sync per batch)."""
        if id(batch) in self._flag_of:
            self._flush_fused(batch)  # the kernel reads the phase from its tensor
            return
        batch = self._at_phase(batch)
        if not batch.items:  # only a phase's repeated last block: compared with its own part
            return
        if batch.items[0].mxfp8_codes:
            self._flush_codes(batch)
            return
        got, want, small = sides(batch, self.references)
        if small is not None and batch.key not in self.trusted:
            reason = self_check(self.references[batch.key], small, want)
            if reason:
                raise Refused(reason)
            self.trusted.add(batch.key)
        self.verdicts.append((batch, batches.values_differ(got, want, self.atol).any()))

    def _flush(self, batch: Batch) -> None:
        try:
            self._compare(batch)
            self.phase.done()
        except Exception as exc:  # noqa: BLE001 - the rank must still join the all-reduce
            reason = str(exc) if isinstance(exc, Refused) else why_type(batch.param, exc)
            self.refused[batch.key], self.reusable = reason, False
            for it in batch.items:
                self.slots[it.slot].unchecked = reason

    def _at_phase(self, batch: Batch) -> Batch:
        """What a run reads of ``batch``: inside a capture its sampled blocks at the device-side
        phase (gathers: the graph serves every phase); in an eager run the call's own phase as
        host arithmetic, kept per phase (strided views, no gather: what an eager run costs where
        a type's write cannot be captured)."""
        if self._capturing or self.stride == 1:
            return batch
        key = (id(batch), self.phase.value)
        if key not in self._eager:
            if len(self._eager) >= _KEPT_PHASES * len(self.planned):  # a very small sample
                self._eager.clear()
            self._eager[key] = at_phase(batch, self.phase.value)
        return self._eager[key]

    def _run_eager(self) -> None:
        self.phase.begin()
        self._new_flags()
        for batch in self.planned:
            if batch.key not in self.refused:
                self._flush(batch)
                continue
            for it in batch.items:  # its type was refused by an earlier batch of this call
                self.slots[it.slot].unchecked = self.refused[batch.key]

    def _capturable(self, first: bool = False) -> bool:
        """On a CUDA device, from the plan's second run on, or at its first where ``first`` (what
        each batch key may do is settled: by an eager run just done, or by the keys' probes)."""
        if self.graph is not None or self.no_graph or not self.reusable or not (self.runs or first):
            return False
        if not self.planned or not graphs.on_cuda(self.planned[0].items[0].main):
            return False
        self.no_graph = graphs.refusal(self._write_paths())  # '' where it may be captured
        return not self.no_graph and not torch.cuda.is_current_stream_capturing()

    def _settled(self) -> bool:
        """Whether no compare syncs with the host at its first run, so a first run may be recorded
        without an eager one before it (one host pass instead of two): only a value-holding MXFP8
        type's reading is self-checked there, unless its probe did it (a codes type's did)."""
        return all(not b.mxfp8 or b.items[0].mxfp8_codes or b.key in self.trusted for b in self.planned)

    def _write_paths(self) -> frozenset[Any]:
        """The plan's batch keys that may fail a capture (a host sync in a quantized type's own
        write), or every key where it has none."""
        keys = frozenset(batch.key for batch in self.planned)
        return frozenset(k for k in keys if k[0] or k[4] is not type(None)) or keys

    def _capture(self, replay: bool = True, tentative: bool = False) -> None:
        """Capture the plan's compares as one CUDA graph (an own-write key of many batches as one
        batch, ``_templates``) and replay it (``replay=False``: after the first, eager run, whose
        verdicts stand; the replay only uploads the graph, which the job's next call then does
        not pay). A reused plan reads the same tensors at the same addresses, so the check costs
        its GPU time, not the host's launches per batch (~300 in a full 4B check). Where the
        type's write cannot be captured (a host sync), ``no_graph`` says why and the plan runs
        eagerly. ``tentative``: a first run recorded with no eager run before it; should that
        fail (a kernel's first compile, a type's first write), it goes eager and is recorded after."""
        for reference in self.references.values():
            reference.release()  # its instance is made inside the capture, in the graph's pool
        self.verdicts = []

        def record() -> torch.Tensor:
            self.phase.begin()
            for template in self.templates:  # replayed after this graph, into what it zeroes
                template.reset()
            self._new_flags()
            self._capturing = True
            try:
                templated = {id(b) for t in self.templates for b in t.batches}
                for batch in (b for b in self.planned if id(b) not in templated):
                    self._compare(batch)
                    self.phase.done()
            finally:
                self._capturing = False
            if not self.verdicts:  # every batch in a template: a graph of one fill, not an empty one
                return torch.zeros(1, dtype=torch.int32, device=self.planned[0].items[0].main.device)
            self.verdicts, verdicts = stack_verdicts(self.verdicts, self._flags)
            return verdicts

        paths = () if tentative else self._write_paths()
        try:
            graph, stacked = graphs.capture(record, paths)
            capture_all(self.templates, self.references, self.phase, paths)
        except graphs.Uncapturable as exc:  # eager compares judge the same
            self.verdicts = []
            for reference in self.references.values():
                reference.release()
            if tentative:  # a first run recorded before any eager one: that order, then a capture
                self._run_eager_then_record()
                return
            self.no_graph, self.templates = str(exc), []  # their buffers serve no graph now
            if replay:
                self._run_eager()
            return
        self.graph, self.graph_stacked = graph, stacked[: len(self.verdicts)]
        self.graph_verdicts = [(batch, stacked[i]) for i, (batch, _) in enumerate(self.verdicts)]
        self.graph_verdicts += [v for t in self.templates for v in t.verdicts()]
        self._replay()
        if replay:
            self.verdicts = self.graph_verdicts

    def _run_eager_then_record(self) -> None:
        """Every compare eagerly, then recorded (its first launch uploads the graph, unread), so
        the job's second call replays; or eagerly only, where the plan is not captured."""
        self._run_eager()
        if self._capturable(first=True):
            eager = self.verdicts
            self._capture(replay=False)
            self.verdicts = eager

    def finish(self, max_names: int) -> None:
        """Flush what is left, read every batch's verdict in one transfer, attribute the
        differences of a failed batch to its params (recomputed: the failure path only), and fill
        the report."""
        for key in list(self.batches):
            self._seal(key)
        self._plan_launches()
        if self.graph is not None:
            if not self._launched:
                self._replay()
            self._launched = False
            self.verdicts = self.graph_verdicts
        elif self._capturable(first=self._settled()):
            self._capture(tentative=not self.runs)
        else:
            self._run_eager_then_record()
        if self.runs == 0 and self.stride <= _KEPT_PHASES:
            self._count_every_phase()
        self.runs += 1
        for reference in self.references.values():
            reference.release()
        # The verdicts are queued on the device; the host counts meanwhile, then reads them once.
        stacked = self.graph_stacked if self.verdicts is self.graph_verdicts else None
        if stacked is not None and self.templates:  # the graph's verdicts, then the templates' counts
            stacked = torch.cat([stacked, *(t.counts for t in self.templates)])
        if stacked is None and self.verdicts:
            self.verdicts, stacked = stack_verdicts(self.verdicts, self._flags)
        self._tally_checked()
        if stacked is not None:
            failed = stacked.tolist()
            done: set[int] = set()
            for (batch, _), bad in zip(self.verdicts, failed, strict=True):
                if bad and id(batch) not in done:
                    done.add(id(batch))
                    self.attribute(at_phase(batch, self.phase.value))
        for slot in (self.slots[i] for i in sorted(self._dirty) if not self.slots[i].unchecked):
            self.report.add_shard_mismatch(slot.name, slot.worst, slot.differing, max_names)

    def _count_every_phase(self) -> None:
        """Every slot's element count at every phase, at the plan's first run (the warm-up), so
        no later call works one out."""
        tables: dict[Any, dict[int, int]] = {}
        for slot in self.slots:
            slot.count_every_phase(self.stride, tables)
            slot.covered(self.phase.value)
        self._per_phase = batches.elements_per_phase(self.slots, self.stride)

    def _tally_checked(self) -> None:
        """What was checked and how (independent of the verdicts): counted once per plan where the
        graph replays (the same params, blocks and paths every time; a phase changes its count)."""
        replayed, value = self.verdicts is self.graph_verdicts, self.phase.value
        report = self._tallies.get(value) if replayed else None
        if report is None and replayed and self._tallies and self._per_phase:
            report = replace(next(iter(self._tallies.values())), elements_checked=self._per_phase[value])
        elif report is None:
            report = WeightReport(event="")
            batches.count_slots(self.slots, value, report)
            self._count_paths(report)
        if replayed:
            self._tallies[value] = report
        self.report.add_checked(report)

    def _count_paths(self, report: WeightReport) -> None:
        for key, reference in self.references.items():
            params = {s for b, _ in self.verdicts if b.key == key for s in (it.slot for it in b.items)}
            count = len(params) + self.empty.get(key, 0)
            if key not in self.refused and count:
                how = ", compared by the fused TE-rule kernel" if key in self.fused else ""
                report.count_path(f"{reference.path}, read {key[-1]}{how}", count)
