"""Defect A: bucket ``param_to_index`` offsets that ignore the 64-element param padding.

megatron-core (<= 0.16) fills ``_ParamAndGradBucket.param_to_index`` with a naive running sum of
numels, while the buffer itself places every param at a 64-element-aligned start whenever the
distributed optimizer is on. The buffer's ``param_index_map`` is the truth (the optimizer and
``main_grad`` views use it); ``param_to_index`` is read only by the MXFP8 copy-back after the
all-gather, which therefore hands a param its neighbour's bytes. We check every bucket against
the buffer's map and rewrite the dict in place; nothing else in megatron-core reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MXFP8AlignmentError, MXFP8UsageError
from .layout import bucket_params, buffers, is_megatron_ddp, padded_range

__all__ = [
    "AlignmentReport",
    "BucketInfo",
    "OffsetMismatch",
    "check_bucket_alignment",
    "iter_buckets",
]

PARAM_ALIGNMENT = 64  # elements; megatron-core pads param starts to this with the dist. optimizer


@dataclass(frozen=True)
class BucketInfo:
    """Where a bucket lives, for reports."""

    chunk: int
    expert: bool
    buffer: int
    bucket: int
    bucket_obj: Any = field(repr=False, compare=False)
    buffer_obj: Any = field(repr=False, compare=False)

    @property
    def label(self) -> str:
        kind = "expert" if self.expert else "dense"
        return f"chunk {self.chunk} {kind} buffer {self.buffer} bucket {self.bucket}"


def iter_buckets(model_chunks: Sequence[Any]) -> Iterator[BucketInfo]:
    """Every bucket of every dense and expert-parallel buffer, in a stable order."""
    for c, chunk in enumerate(model_chunks):
        if not is_megatron_ddp(chunk):
            raise MXFP8UsageError(
                f"model chunk {c} is {type(chunk).__name__}, not megatron-core DistributedDataParallel; "
                "pass the DDP-wrapped chunks (the list Megatron-Bridge hands callbacks as context.model)"
            )
    for ref in buffers(model_chunks):
        for k, bucket in enumerate(ref.bucket_list):
            yield BucketInfo(ref.chunk_index, ref.expert, ref.index, k, bucket, ref.buffer)


@dataclass(frozen=True)
class OffsetMismatch:
    where: str
    param: str
    found: tuple[int, int]
    expected: tuple[int, int]


@dataclass
class AlignmentReport:
    """What :func:`check_bucket_alignment` saw and did."""

    buckets: int = 0
    params: int = 0
    mismatches: list[OffsetMismatch] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        """True when megatron-core's offsets were already right (defect A absent)."""
        return not self.mismatches

    def summary(self) -> str:
        if self.clean:
            return f"bucket offsets: {self.params} params in {self.buckets} buckets already correct"
        verb = "repaired" if self.repaired else "found (not repaired)"
        return (
            f"bucket offsets: {len(self.mismatches)} of {self.params} params in {self.buckets} buckets "
            f"had param_to_index ignoring the 64-element padding; {verb}"
        )


def check_bucket_alignment(model_chunks: Sequence[Any], *, repair: bool = True) -> AlignmentReport:
    """Compare every ``bucket.param_to_index`` with the buffer's padded layout; repair in place.

    Raises :class:`MXFP8AlignmentError` for what no dict edit can fix: a param start that is not
    64-aligned although the distributed optimizer is on, or a param outside its bucket.
    Idempotent: a second call finds nothing to repair.
    """
    report = AlignmentReport(repaired=repair)
    names = {}
    for chunk in model_chunks:
        names.update(
            {p: n for n, p in chunk.named_parameters()} if hasattr(chunk, "named_parameters") else {}
        )
    problems: list[str] = []
    for info in iter_buckets(model_chunks):
        report.buckets += 1
        bucket, buffer = info.bucket_obj, info.buffer_obj
        dist_opt = bool(buffer.ddp_config.use_distributed_optimizer)
        bucket_numel = bucket.grad_data.numel()
        for param in bucket_params(bucket):
            report.params += 1
            want = padded_range(buffer, bucket, param)
            name = names.get(param, f"<param {tuple(param.shape)}>")
            if dist_opt and (want[0] + bucket.offset) % PARAM_ALIGNMENT:
                problems.append(
                    f"{info.label}: {name} starts at element {want[0] + bucket.offset}, not a multiple of 64"
                )
            if want[0] < 0 or want[1] > bucket_numel:
                problems.append(
                    f"{info.label}: {name} range {want} lies outside the bucket ({bucket_numel} elements)"
                )
            found = tuple(bucket.param_to_index[param])
            if found != want:
                report.mismatches.append(OffsetMismatch(info.label, name, found, want))  # type: ignore[arg-type]
                if repair:
                    bucket.param_to_index[param] = want
    if problems:
        raise MXFP8AlignmentError(
            "bucket layout cannot be repaired (param starts must be 64-element aligned with "
            "use_distributed_optimizer=True):\n  " + "\n  ".join(problems)
        )
    return report
