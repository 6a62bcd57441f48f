"""The weight verifier's cost (``verify_weights``, what ``PluginOptions(verify_weights=True)`` runs
after every forced sync), right after an eval transition.

* :func:`measure_verify`, part of ``eval_sync.py worker`` (emulated-MXFP8 type): time per call,
  extra peak memory, memory left allocated afterwards (must be 0) and whether it found the weights
  right, with each quantizer, at the default block sample (``verify_*``) and at 1.0
  (``verify_full_*``).
* ``eval_sync.py verify`` / ``verify-worker`` (:func:`run_verify`, :func:`verify_worker`), on the
  TE-shaped type (``MXFP8_PARAM_KIND=te``): eval transition with the emulated and a one-pass cast,
  sampled and full check (first calls, CUDA-graph capture, steady replay), extra peak memory, the
  graphs' pool, and the full check's floor; writes ``verify_te.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _casts import nothing, one_pass_te, plain_quantizer
from _job import (
    allocated,
    between_evals,
    core_env,
    finish_ranks,
    measure_sizes,
    peak_extra,
    prepared_job,
    prestaged_transition,
    start_ranks,
    sync,
    timed,
    timeit,
    torchrun,
)

#: Issue 23's targets for the verifier on the TE-shaped type at 4B, with the one-pass cast.
VERIFY_TARGETS = {"sampled_vs_eval": 0.25, "full_vs_eval": 1.0, "sampled_peak_bytes": 64 << 20}


# ------------------------------------------------------ the verifier on the emulated type
def measure_verify(job: Any, reset: Any, transition: Any) -> dict[str, Any]:
    """The verifier after an eval transition, with the emulated (TE-rule) and the one-pass
    quantizer, at the default block sample (``verify_*``, what the option runs) and at 1.0
    (``verify_full_*``, every block): each run checks weights that the same quantizer wrote, so
    it must find them right."""
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE

    res: dict[str, Any] = {"verify_sample": DEFAULT_VERIFY_SAMPLE}
    for suffix, quant in (("", None), ("_plainquant", plain_quantizer)):
        with quant() if quant else nothing():
            reset()
            transition()  # the weights are current: what the option checks after an eval
            for kind, sample in (("verify", DEFAULT_VERIFY_SAMPLE), ("verify_full", 1.0)):

                def check(sample: float = sample) -> Any:
                    return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

                report = check()
                res[f"{kind}{suffix}_ok"] = report.ok
                res[f"{kind}{suffix}_params_checked"] = report.params_checked
                res[f"{kind}{suffix}_elements_checked"] = report.elements_checked
                res[f"{kind}{suffix}_s"] = timeit(check)
                before = allocated()
                res[f"{kind}{suffix}_peak_extra_bytes"] = peak_extra(check)
                res[f"{kind}{suffix}_persistent_bytes"] = int(allocated() - before)
    return res


# ------------------------------------------------------- the verifier on the TE-shaped type
def _graph_pool_bytes(module: Any) -> int:
    """Device memory the kept plans' CUDA graphs hold (their shared pool): reserved bytes with
    the plans, less without them, each after emptying the allocator's cache. Drops the plans."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with_plans = torch.cuda.memory_reserved()
    module._PLANS.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return int(with_plans - torch.cuda.memory_reserved())


def _verify_floor_bytes(job: Any) -> tuple[int, int]:
    """Bytes the full check must read (main shards and owned param bytes; every param's bytes
    when there is a replica to compare with), and the param bytes this rank holds."""
    import torch

    from mbridge_mxfp8_plugin.mcore.layout import bucket_params, buffers, distributed_optimizers, main_shards

    owned = {
        s.param: (s.param_start, s.param_end)
        for opt in distributed_optimizers(job.optimizer)
        for s in main_shards(opt)
    }
    world = torch.distributed.get_world_size()
    held = 0
    need = 0
    for ref in buffers(list(job.model)):
        for bucket in ref.bucket_list:
            for p in bucket_params(bucket):
                per = 1 + 1 / 32 if hasattr(p, "_rowwise_data") else p.element_size()  # codes + scales
                held += int(p.numel() * (2 if hasattr(p, "_columnwise_data") else 1) * per)
                o = owned.get(p)
                if o is not None:
                    need += int((o[1] - o[0]) * (4 + per))
                if world > 1:
                    need += int(p.numel() * per)
    return need, held


def _measure_te_check(job: Any, key: str, sample: float) -> dict[str, Any]:
    """One check (``key`` = kind_cast) at ``sample``: its first calls, each phase's capture as a
    CUDA graph, the steady replay, what it found, its graphs and its memory."""
    from mbridge_mxfp8_plugin import verify_weights
    from mbridge_mxfp8_plugin.verify import weights as verify_weights_module

    def check() -> Any:
        return verify_weights(job.model, job.optimizer, event="benchmark", sample=sample)

    res: dict[str, Any] = {}
    # The first call of a job (and of each sampled phase) makes the check's plan; the
    # second of a phase captures it as a CUDA graph; later calls replay it.
    verify_weights_module._PLANS.clear()
    sync()
    t0 = time.perf_counter()
    report = check()
    sync()
    res[f"{key}_first_s"] = time.perf_counter() - t0
    res[f"{key}_ok"] = report.ok and not report.unchecked
    res[f"{key}_unchecked"] = len(report.unchecked)
    res[f"{key}_paths"] = report.reference_paths
    res[f"{key}_fused"] = any("fused" in p for p in report.reference_paths)
    res[f"{key}_elements"] = report.elements_checked
    stride = round(1 / sample)
    first_round = [timed(check) for _ in range(stride - 1)]  # the other phases' first calls
    second_round = [timed(check) for _ in range(stride)]  # each phase's capture
    res[f"{key}_first_round_s"] = statistics.median([res[f"{key}_first_s"], *first_round])
    res[f"{key}_second_round_s"] = statistics.median(second_round)
    for _ in range(stride):
        check()
    res[f"{key}_s"] = timeit(check)  # steady state: every phase replayed
    res[f"{key}_ok_steady"] = check().ok
    plans = [
        plan.check for layout in list(verify_weights_module._PLANS.values()) for plan in layout.plans.values()
    ]
    res[f"{key}_graphs"] = sum(c.graph is not None for c in plans)
    res[f"{key}_no_graph"] = sorted({c.no_graph for c in plans if c.no_graph})
    res[f"{key}_graph_pool_bytes"] = _graph_pool_bytes(verify_weights_module)
    # The eager run of a fresh plan allocates what a replay reuses from its pool.
    before = allocated()
    res[f"{key}_peak_extra_bytes"] = peak_extra(check)
    res[f"{key}_persistent_bytes"] = int(allocated() - before)
    return res


def measure_verify_te(label: str, hidden: int, layers: int) -> dict[str, Any]:
    """Eval transition, sampled and full check, peak memory and the full check's floor, on the
    TE-shaped type, with the emulated (TE-rule) cast and with the one-pass cast."""
    import torch

    from mbridge_mxfp8_plugin.options import DEFAULT_VERIFY_SAMPLE

    job, engine = prepared_job(hidden, layers)
    world = torch.distributed.get_world_size()
    res: dict[str, Any] = {"size": label, "params": sum(p.numel() for p in job.model[0].parameters())}
    res["dp"], res["sample"] = world, DEFAULT_VERIFY_SAMPLE
    res["mxfp8_type"] = sorted({type(p).__name__ for p in job.model[0].parameters()})
    reset = between_evals(engine)

    def transition() -> None:  # the Bridge callback's eval path (see eval_transition.py)
        prestaged_transition(job, engine)

    for cast, quant in (("emulated", None), ("onepass", one_pass_te)):
        with quant() if quant else nothing():
            res[f"eval_{cast}_s"] = timeit(transition, reset)
            reset()
            transition()  # the weights are current: what the option checks after an eval
            for kind, sample in (("sampled", DEFAULT_VERIFY_SAMPLE), ("full", 1.0)):
                res.update(_measure_te_check(job, f"{kind}_{cast}", sample))
    need, held = _verify_floor_bytes(job)
    dev = job.model[0].module.layers[0].bias.device
    big = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB: launch costs negligible
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * big.element_size() / timeit(lambda: dst.copy_(big))  # read + write
    res.update(full_floor_bytes=need, param_bytes_held=held, copy_bandwidth_Bps=bw, full_floor_s=need / bw)
    return res


def verify_worker(args: argparse.Namespace) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ["MXFP8_PARAM_KIND"] = "te"
    from mbridge_mxfp8_plugin.testing import cpu_shim, emulated_mxfp8

    start_ranks()
    import megatron.core

    out: dict[str, Any] = {"core": megatron.core.__version__, "torch": torch.__version__, "sizes": []}
    with cpu_shim(), emulated_mxfp8():
        measure_sizes(out, args.sizes, measure_verify_te)
    finish_ranks(out, args.json)


# ------------------------------------------------------------------------------ the report
def verify_rows(raw: dict[str, Any], core: str) -> list[dict[str, Any]]:
    """Ratios and checks per size, flat (one CSV row each)."""
    rows = []
    for size in raw["sizes"]:
        row = {"core": core, **{k: v for k, v in size.items() if not k.endswith("_paths")}}
        row["mxfp8_type"] = ",".join(size["mxfp8_type"])
        for cast in ("onepass", "emulated"):
            for kind in ("sampled", "full"):
                row[f"ratio_{kind}_vs_eval_{cast}"] = size[f"{kind}_{cast}_s"] / size[f"eval_{cast}_s"]
                for when in ("first", "first_round", "second_round"):
                    if f"{kind}_{cast}_{when}_s" in size:
                        ratio = size[f"{kind}_{cast}_{when}_s"] / size[f"eval_{cast}_s"]
                        row[f"ratio_{kind}_{when}_vs_eval_{cast}"] = ratio
        row["ratio_full_vs_floor"] = size["full_onepass_s"] / size["full_floor_s"]
        # TE's rule (the emulated cast's weights): the check takes the fused kernel where it may
        # (verify/fused.py), and then costs no cast at all: set against the one-pass transition.
        row["fused"] = bool(size.get("sampled_emulated_fused") and size.get("full_emulated_fused"))
        if row["fused"]:
            for kind in ("sampled", "full"):
                for when in ("", "_first", "_first_round"):
                    if f"{kind}_emulated{when}_s" in size:
                        ratio = size[f"{kind}_emulated{when}_s"] / size["eval_onepass_s"]
                        row[f"ratio_{kind}{when}_fused_vs_eval_onepass"] = ratio
            row["ratio_full_fused_vs_floor"] = size["full_emulated_s"] / size["full_floor_s"]
        budget = max(VERIFY_TARGETS["sampled_peak_bytes"], size["param_bytes_held"] // 100)
        row["peak_budget_bytes"] = budget
        row["pass_no_false_alarm"] = all(
            size[f"{k}_{c}_{ok}"]
            for k in ("sampled", "full")
            for c in ("onepass", "emulated")
            for ok in ("ok", "ok_steady")
            if f"{k}_{c}_{ok}" in size
        )
        row["pass_peak"] = all(
            size[f"{k}_{c}_peak_extra_bytes"] <= budget
            for k in ("sampled", "full")
            for c in ("onepass", "emulated")
        )
        row["pass_sampled_vs_eval"] = (
            row["ratio_sampled_vs_eval_onepass"] <= VERIFY_TARGETS["sampled_vs_eval"]
        )
        row["pass_full_vs_eval"] = row["ratio_full_vs_eval_onepass"] <= VERIFY_TARGETS["full_vs_eval"]
        if row["fused"]:
            sampled = row["ratio_sampled_fused_vs_eval_onepass"]
            full = row["ratio_full_fused_vs_eval_onepass"]
            row["pass_sampled_fused_vs_eval"] = sampled <= VERIFY_TARGETS["sampled_vs_eval"]
            row["pass_full_fused_vs_eval"] = full <= VERIFY_TARGETS["full_vs_eval"]
        rows.append(row)
    return rows


def verify_plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot at {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("eval transition, one-pass cast", "eval_onepass_s"),
        ("eval transition, emulated cast", "eval_emulated_s"),
        ("sampled check, TE's rule (fused kernel)", "sampled_emulated_s"),
        ("full check, TE's rule (fused kernel)", "full_emulated_s"),
        ("full check, another rule (type's own write)", "full_onepass_s"),
        ("full check's floor (bytes / HBM bw)", "full_floor_s"),
    ]
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{r['size']}\ncore {r['core']}" for r in rows]
    width = 0.13
    for i, (name, key) in enumerate(series):
        ax.bar(
            [x + (i - 2.5) * width for x in range(len(rows))], [r[key] * 1e3 for r in rows], width, label=name
        )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"verify_weights on the TE-shaped MXFP8 type, DP={rows[0]['dp'] if rows else '?'}")
    ax.legend(fontsize=7, loc="lower left")
    peaks = ("sampled_emulated_peak_extra_bytes", "full_emulated_peak_extra_bytes",
             "sampled_onepass_peak_extra_bytes", "full_onepass_peak_extra_bytes")  # fmt: skip
    for i, key in enumerate(peaks):
        mem.bar(
            [x + (i - 1.5) * 0.2 for x in range(len(rows))], [r[key] / 2**20 for r in rows], 0.2, label=key
        )
    mem.axhline(VERIFY_TARGETS["sampled_peak_bytes"] / 2**20, color="k", ls="--", label="64 MiB")
    mem.set_xticks(range(len(rows)), labels)
    mem.set_ylabel("extra peak memory, MiB")
    mem.set_title("torch.cuda.max_memory_allocated - allocated before")
    mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _verify_checks(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    return [
        (f"{r['size']} core {r['core']}: {name}", bool(r[key]))
        for r in rows
        for name, key in (
            ("no false alarm, nothing unchecked", "pass_no_false_alarm"),
            ("peak <= budget", "pass_peak"),
        )
    ] + [
        (f"{r['size']} core {r['core']}: {name}", bool(r[key]))
        for r in rows
        if r["size"] == "4B"
        for name, key in (
            ("TE's rule (fused kernel): sampled <= 0.25 x eval (one-pass)", "pass_sampled_fused_vs_eval"),
            ("TE's rule (fused kernel): full <= 1.0 x eval (one-pass)", "pass_full_fused_vs_eval"),
            ("another rule (own write): sampled <= 0.25 x eval (one-pass)", "pass_sampled_vs_eval"),
            ("another rule (own write): full <= 1.0 x eval (one-pass)", "pass_full_vs_eval"),
        )  # fmt: skip
        if key in r
    ]


def run_verify(args: argparse.Namespace) -> int:
    """One worker per core install (or the current environment), then JSON, CSV and a plot."""
    import csv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in [] if args.no_run else args.core or ["installed="]:
        version, path = spec.split("=", 1)
        json_path = out / f"verify_te_core{version.replace('.', '')}.json"
        env = core_env(path, MXFP8_PARAM_KIND="te")
        cmd = torchrun(args.nproc, "verify-worker", "--sizes", args.sizes, "--json", str(json_path))
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)
    # Every core's raw result in the folder, also from earlier invocations (one per core keeps
    # each run inside a time limit), makes one table.
    raws = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("verify_te_core*.json"))}
    rows = [row for raw in raws.values() for row in verify_rows(raw, raw["core"])]
    checks = _verify_checks(rows)
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    result = {
        "targets": VERIFY_TARGETS,
        "rows": rows,
        "raw": raws,
        "checks": checks,
        "all_pass": all(c[1] for c in checks),
    }
    (out / "verify_te.json").write_text(json.dumps(result, indent=2))
    with open(out / "verify_te.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    verify_plot(rows, out / "verify_te.png")
    print(f"verify_te: {'PASS' if result['all_pass'] else 'FAIL'} ({out}/verify_te.{{json,csv,png}})")
    return 0
