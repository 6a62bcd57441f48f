"""MX008: the distributed optimizer pads buckets for the data-parallel size; check it fits."""

from __future__ import annotations

import math

from ..effective import EffectiveConfig
from ..report import Finding, Rule, RuleResult
from ._base import _found, _na, _pass, _rule, _violation


@_rule("MX008", "bucket padding for this dp_size")
def _mx008(ctx: EffectiveConfig, rule: Rule) -> RuleResult:
    dp = ctx.dp_size
    dist = ctx.ddp("use_distributed_optimizer")
    if dp is None:
        return _na(rule, "pass --dp-size (or mxfp8_plugin.dp_size) to check DP padding", "dp_size")
    if dp < 1:
        return _violation(rule, "error", "dp_size", dp, f"dp_size must be >= 1, got {dp}")
    if not dist.known:
        return _na(rule, "use_distributed_optimizer comes from the base config", dist.path)
    if not dist.value:
        # Only the distributed optimizer shards buffers, so only it pads them.
        return _pass(rule, "no distributed optimizer: megatron-core does not pad", dist.path, False)
    inst_v = ctx.ddp("num_distributed_optimizer_instances")
    inst = inst_v.value if inst_v.known and isinstance(inst_v.value, int) and inst_v.value > 0 else 1
    busbw_v = ctx.ddp("pad_buckets_for_high_nccl_busbw")
    # With high-busbw padding, bucket ends also align to 2**16 elements (see _padding_waste).
    divisors = (128, 2**16) if busbw_v.known and busbw_v.value else (128,)
    cp = ctx.model_int("context_parallel_size", 1)
    out: list[Finding] = []
    notes: list[str] = []
    dense_group = dp * cp  # the dense params' data-parallel group spans the CP ranks too
    if dense_group % inst:
        # The instances split the data-parallel group into equal parts, or nothing builds.
        why = (
            f"dp_size*cp={dense_group} is not divisible by num_distributed_optimizer_instances={inst}: "
            "megatron-core cannot split the data-parallel group into equal optimizer instances"
        )
        out.append(_one_instance(rule, inst_v.path, inst, why))
    else:
        div = math.lcm(dense_group // inst, *divisors)
        notes.append(
            f"dense bucket ends padded to lcm({dense_group // inst},{','.join(map(str, divisors))})={div}"
        )
        out.extend(_padding_waste(ctx, rule, div, dp, busbw_v.path))
    out.extend(_expert_padding(ctx, rule, dp, inst, inst_v.path, divisors, notes))
    if out:
        return _found(rule, out, "dp_size", dp)
    return _pass(
        rule,
        "param starts padded to 64 elements; " + "; ".join(notes) + " (megatron-core pads itself)",
        "dp_size",
        dp,
    )


def _one_instance(rule: Rule, path: str, inst: int, why: str) -> Finding:
    return Finding(rule.id, "error", path, inst, why, {"ddp": {"num_distributed_optimizer_instances": 1}})


def _expert_padding(
    ctx: EffectiveConfig,
    rule: Rule,
    dp: int,
    inst: int,
    inst_path: str,
    divisors: tuple[int, ...],
    notes: list[str],
) -> list[Finding]:
    """Expert buffers are sharded over the expert data-parallel group, which exists only when
    expert parallelism times expert TP divides the ranks a dense layer spans (dp*cp*tp)."""
    tp, cp = ctx.model_int("tensor_model_parallel_size", 1), ctx.model_int("context_parallel_size", 1)
    ep = ctx.model_int("expert_model_parallel_size", 1)
    if ep <= 1:
        return []
    etp_v = ctx.model("expert_tensor_parallel_size")
    etp = etp_v.value if etp_v.known and isinstance(etp_v.value, int) else tp  # unset: follows TP
    if (dp * cp * tp) % (ep * etp):
        why = (
            f"dp_size*cp*tp={dp * cp * tp} is not divisible by expert_model_parallel_size*"
            f"expert_tensor_parallel_size={ep * etp}: there is no integral expert data-parallel "
            "group (megatron-core's initialize_model_parallel fails), so expert buffers cannot be sharded"
        )
        fix = f"# choose expert_model_parallel_size * expert_tensor_parallel_size dividing {dp * cp * tp}"
        return [Finding(rule.id, "error", "model.expert_model_parallel_size", ep, why, fix)]
    edp = dp * cp * tp // (ep * etp)
    if edp % inst:
        why = (
            f"expert data-parallel size {edp} is not divisible by num_distributed_optimizer_instances={inst}"
        )
        return [_one_instance(rule, inst_path, inst, why)]
    notes.append(f"expert bucket ends padded to {math.lcm(edp // inst, *divisors)} (expert DP {edp})")
    return []


def _padding_waste(ctx: EffectiveConfig, rule: Rule, div: int, dp: int, busbw_path: str) -> list[Finding]:
    """Padding megatron-core adds is correct by construction; only its size can hurt."""
    ogr, bucket = ctx.ddp("overlap_grad_reduce"), ctx.ddp("bucket_size")
    if ogr.known and not ogr.value:
        if bucket.known and bucket.value is not None:
            return [
                Finding(
                    rule.id,
                    "warning",
                    bucket.path,
                    bucket.value,
                    "bucket_size is ignored without overlap_grad_reduce (megatron-core uses one bucket "
                    "per buffer)",
                    {"ddp": {"bucket_size": None}},
                )
            ]
        return []
    size = bucket.value if bucket.known and isinstance(bucket.value, int) else max(40_000_000, 1_000_000 * dp)
    if (div - 1) / size <= 0.05:
        return []
    return [
        Finding(
            rule.id,
            "warning",
            busbw_path if div >= 2**16 else bucket.path,
            div,
            f"each bucket end is padded to a multiple of {div} elements, up to {div - 1} wasted per "
            f"{size}-element bucket ({100 * (div - 1) / size:.0f}%) in both the param and the grad buffer",
            {"ddp": {"pad_buckets_for_high_nccl_busbw": False}}
            if div >= 2**16
            else {"ddp": {"bucket_size": None}},
        )
    ]
