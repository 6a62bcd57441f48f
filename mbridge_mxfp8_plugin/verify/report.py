"""What a weight check found: the report every rank gets back, and its one-line message."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MXFP8PluginError

__all__ = ["ParamMismatch", "WeightReport"]


@dataclass(frozen=True)
class ParamMismatch:
    """One param whose shard differs from its quantized main shard (on the rank that reports it)."""

    name: str
    max_abs_diff: float
    elements: int  # how many compared elements differ

    def __str__(self) -> str:
        return f"{self.name} (max |diff| {self.max_abs_diff:.3g}, {self.elements} elements)"


@dataclass
class WeightReport:
    """What :func:`~mbridge_mxfp8_plugin.verify_weights` found on this rank (and, through the
    all-reduce, on its peers)."""

    event: str
    #: params whose owned shard was compared, and the elements compared / skipped
    params_checked: int = 0
    elements_checked: int = 0
    #: elements of MXFP8 blocks split between two ranks' shards (their scale is not local)
    elements_skipped: int = 0
    #: ``name: reason`` for owned params that could not be compared (e.g. per-tensor FP8, or a
    #: param type whose own write path could not be reproduced): never counted as a mismatch
    unchecked: list[str] = field(default_factory=list)
    #: this rank's shard mismatches, first ``max_names`` of them, and their total count
    shard_mismatches: list[ParamMismatch] = field(default_factory=list)
    shard_mismatch_count: int = 0
    #: the largest shard mismatch count of any rank in this rank's data-parallel group
    peer_mismatch_count: int = 0
    #: params whose bits differ between data-parallel replicas (first ``max_names``), and how many
    replica_mismatches: list[str] = field(default_factory=list)
    replica_mismatch_count: int = 0
    #: params hashed for the replica check; data-parallel groups reduced over (size > 1)
    params_hashed: int = 0
    groups_reduced: int = 0
    #: how each compared param's reference was made and its blocks read, e.g.
    #: ``"EmulatedMXFP8Tensor via copy_, read values"`` -> params
    reference_paths: dict[str, int] = field(default_factory=dict)
    #: fraction of blocks compared (1.0: every block); see ``verify_weights``'s ``sample``
    sample: float = 1.0
    note: str = ""
    seconds: float = 0.0
    #: MXFP8 weights compared, and those that could not be read (their type names, in order seen)
    mxfp8_checked: int = 0
    mxfp8_unchecked: int = 0
    unchecked_types: list[str] = field(default_factory=list)
    #: take NOT CHECKED as a pass (``verify_accept_unchecked``): the user knows the type is unreadable
    accept_unchecked: bool = False

    def add_unchecked(self, name: str, reason: str, mxfp8_type: str = "") -> None:
        """An owned param that could not be compared; ``mxfp8_type`` names an MXFP8 weight's type."""
        self.unchecked.append(f"{name}: {reason}")
        if mxfp8_type:
            self.mxfp8_unchecked += 1
            if mxfp8_type not in self.unchecked_types:
                self.unchecked_types.append(mxfp8_type)

    @property
    def verdict(self) -> str:
        """``wrong`` (a mismatch), ``not checked`` (an MXFP8 weight could not be read: the check
        cannot vouch for the weights the defects corrupt), else ``ok``."""
        if self.shard_mismatch_count or self.peer_mismatch_count or self.replica_mismatch_count:
            return "wrong"
        return "not checked" if self.mxfp8_unchecked else "ok"

    @property
    def ok(self) -> bool:
        """True only when nothing differs and every MXFP8 weight was read (or ``accept_unchecked``)."""
        return self.verdict == "ok" or (self.verdict == "not checked" and self.accept_unchecked)

    def message(self) -> str:
        """One line for a log: the event, the verdict and the first offending params."""
        head = f"MXFP8 weight check at {self.event}:"
        if self.verdict == "not checked":
            owned = self.params_checked + len(self.unchecked)
            every = " (every MXFP8 weight)" if not self.mxfp8_checked else ""
            accepted = "; accepted (verify_accept_unchecked)" if self.accept_unchecked else ""
            return (
                f"{head} NOT CHECKED: {self.mxfp8_unchecked} of {owned} owned params{every}, MXFP8 "
                f"weights of type {', '.join(self.unchecked_types)} that the check cannot read "
                f"(first: {self.unchecked[0]}); {self.params_checked} params compared equal{accepted}"
            )
        if self.ok:
            unchecked = f"; {len(self.unchecked)} params unchecked" if self.unchecked else ""
            return (
                f"{head} OK ({self.params_checked} owned params, {self.elements_checked} elements"
                f"{'' if self.sample >= 1.0 else f' (sample {self.sample:.3g})'} equal "
                f"their quantized fp32 main params; {self.params_hashed} params agree across "
                f"{self.groups_reduced} data-parallel group(s){unchecked})"
            )
        parts = []
        if self.shard_mismatch_count:
            first = ", ".join(str(m) for m in self.shard_mismatches)
            parts.append(
                f"{self.shard_mismatch_count} params differ from their quantized fp32 main params on "
                f"this rank (first: {first})"
            )
        elif self.peer_mismatch_count:
            parts.append(f"a data-parallel peer found {self.peer_mismatch_count} params that differ")
        if self.replica_mismatch_count:
            parts.append(
                f"{self.replica_mismatch_count} params differ between data-parallel replicas "
                f"(first: {', '.join(self.replica_mismatches)})"
            )
        return f"{head} WRONG: " + "; ".join(parts)

    def raise_if_bad(self) -> None:
        """Raise :class:`MXFP8PluginError` with :meth:`message` when the check failed."""
        if not self.ok and self.verdict == "not checked":
            raise MXFP8PluginError(
                self.message() + ". The check cannot vouch for these weights; docs/verify.md names the "
                "types it reads (verify_accept_unchecked=true takes this as a pass)"
            )
        if not self.ok:
            raise MXFP8PluginError(
                self.message() + ". The model computes with weights that are not the optimizer's; "
                "see docs/verify.md"
            )

    def count_path(self, path: str, params: int = 1) -> None:
        self.reference_paths[path] = self.reference_paths.get(path, 0) + params

    def add_shard_mismatch(self, name: str, worst: float, differing: int, max_names: int) -> None:
        """One more param whose shard differs; the first ``max_names`` are named."""
        self.shard_mismatch_count += 1
        if len(self.shard_mismatches) < max_names:
            self.shard_mismatches.append(ParamMismatch(name, worst, differing))

    def add_checked(self, tally: WeightReport) -> None:
        """Add what ``tally`` counted as compared and as unchecked: a replayed plan keeps one
        per phase (the same params, blocks and paths at every replay of it), which costs less
        than counting its params again at every check."""
        self.params_checked += tally.params_checked
        self.mxfp8_checked += tally.mxfp8_checked
        self.elements_checked += tally.elements_checked
        self.elements_skipped += tally.elements_skipped
        self.unchecked.extend(tally.unchecked)
        self.mxfp8_unchecked += tally.mxfp8_unchecked
        self.unchecked_types.extend(t for t in tally.unchecked_types if t not in self.unchecked_types)
        for path, params in tally.reference_paths.items():
            self.count_path(path, params)
