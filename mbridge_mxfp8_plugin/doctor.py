"""``mxfp8-plugin doctor``: which MXFP8 param-gather defects the installed stack has, and the fix.

Reads behaviour, not version strings: megatron-core classes are probed (``upstream.probe_core``,
``upstream.probe_bucket_offsets``), Megatron-Bridge's loop is read as text from its installed
``training/train.py`` (importing Bridge needs Transformer Engine). Always exits 0; ``--json``
prints the same report machine-readably. docs/compatibility.md lists the result per release pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, TextIO

__all__ = ["add_doctor_parser", "diagnose", "render"]

DEFECTS = ("A", "B1", "B2", "C", "E")

_WHAT = {
    "A": "bucket param_to_index ignores the 64-element param padding: the MXFP8 copy-back after the "
    "all-gather hands params their neighbours' values",
    "B1": "a forced (synchronous) param all-gather before eval/save does not write the gathered weights "
    "into the params: eval and saves see the previous iteration's weights",
    "B2": "the training loop does not stage the fp32 main params before its forced all-gather: the "
    "shared buffer still holds gradients, which become the weights wherever core writes them back",
    "C": "param_gather_dispatched stays set after a forced sync: the next training step skips gather, "
    "copy-back and re-zeroing (polluted gradients, stale weights)",
    "E": "eval-only jobs (skip_train) keep the forward pre-hooks on: the first eval forward gathers the "
    "never-staged shared buffer over the loaded weights",
}


def _plugin_action(defect: str, present: bool, partial: str = "") -> str:
    if not present:
        return {
            "A": "nothing to repair (offsets checked at on_train_start)",
            "B1": "nothing: core writes forced gathers back",
            "B2": "nothing: the loop stages before every forced sync; the callback stays passive",
            "C": "nothing: core resets the dispatch state when the loop stages",
            "E": "nothing",
        }[defect]
    return {
        "A": "rewrites bucket.param_to_index from the buffer's padded layout at on_train_start",
        "B1": "writes the gathered buffer into the params and re-zeroes it (on_eval_start, on_test_start, "
        "on_train_end; before saves at on_train_step_end)",
        "B2": "stages the main params at on_train_step_end before the loop's forced sync"
        + (f" ({partial})" if partial else "")
        + "; no extra all-gather",
        "C": "resets param_gather_dispatched at on_train_step_start / on_eval_end / on_checkpoint_save",
        "E": "keeps the loaded weights: marks the bucket groups synced at on_eval_start without an optimizer",
    }[defect]


def diagnose() -> dict[str, Any]:
    """The report as a dict (what ``--json`` prints)."""
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from .upstream import installed_versions, probe_bridge_files

    report: dict[str, Any] = {
        "versions": installed_versions(),
        "core": None,
        "bridge_loop": None,
        "defects": {},
    }
    loop = probe_bridge_files()
    report["bridge_loop"] = loop.as_dict() if loop else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from .upstream import probe_bucket_offsets, probe_core

            core = probe_core()
            offsets_ok = probe_bucket_offsets()
    except Exception as exc:  # noqa: BLE001 - report, never crash: doctor is for broken setups too
        report["error"] = f"megatron-core could not be probed: {type(exc).__name__}: {exc}"
        return report
    report["core"] = {**core.as_dict(), "bucket_offsets_padded": offsets_ok}
    if not core.has_reuse_knob:
        report["error"] = "megatron-core has no reuse_grad_buf_for_mxfp8_param_ag: nothing to fix"
        return report
    present = {
        "A": not offsets_ok,
        "B1": not core.forced_sync_writes_back,
        "C": not core.has_dispatch_reset,
        "E": True,  # no release stages or guards before an eval-only job's first forward
    }
    partial = ""
    if loop is None:
        present["B2"] = True
        partial = "no Megatron-Bridge installed: assumed for any loop that does not stage"
    elif loop.stages_before_every_forced_sync:
        present["B2"] = False
    elif loop.stages_before_eval:
        present["B2"] = True
        partial = "the loop stages before evals only; saves and the closing sync are not staged"
    else:
        present["B2"] = True
    for d in DEFECTS:
        report["defects"][d] = {
            "present": present[d],
            "what": _WHAT[d],
            "plugin": _plugin_action(d, present[d], partial if d == "B2" else ""),
        }
    training_defects = [d for d in ("A", "B1", "B2", "C") if present[d]]
    report["present"] = training_defects
    report["plugin_mode"] = (
        "active" if training_defects else "passive (training); holds weights for eval-only jobs"
    )
    return report


def render(report: dict[str, Any], out: TextIO = sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("mxfp8-plugin doctor")
    p("installed:")
    for name, ver in report["versions"].items():
        p(f"  {name:<20} {ver or '-'}")
    loop = report.get("bridge_loop")
    if loop:
        p(f"Megatron-Bridge loop ({loop['source']}):")
        p(f"  stages main params before eval's forced sync:      {loop['stages_before_eval']}")
        p(f"  stages before every forced sync (eval/save/end):   {loop['stages_before_every_forced_sync']}")
        p(
            "  on_train_start before the initial hook disable:    "
            f"{loop['on_train_start_before_initial_disable']}"
        )
        p(f"  on_eval_start after model.eval():                  {loop['on_eval_start_after_model_eval']}")
        p(f"  fires on_checkpoint_save (after the save):         {loop['fires_on_checkpoint_save']}")
    else:
        p("Megatron-Bridge: not installed (B2 judged for a loop that does not stage)")
    if report.get("error"):
        p(f"error: {report['error']}")
        return
    p("defects (MXFP8 params + fp8_param_gather + reuse_grad_buf_for_mxfp8_param_ag + overlap_param_gather):")
    for d, info in report["defects"].items():
        mark = "PRESENT" if info["present"] else "fixed  "
        p(f"  {d:<3} {mark}  {info['what']}")
        p(f"               plugin: {info['plugin']}")
    listed = ", ".join(report["present"]) or "none"
    p(f"training defects present: {listed}; plugin mode: {report['plugin_mode']}")


def _cmd_doctor(args: argparse.Namespace) -> int:
    report = diagnose()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        render(report)
    return 0


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="installed versions, which MXFP8 param-gather defects they have, what the plugin does (exit 0)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_cmd_doctor)
    return parser
