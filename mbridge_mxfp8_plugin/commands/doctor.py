"""``mxfp8-plugin doctor``: which MXFP8 param-gather defects the installed stack has, and the fix.

Renders the one defect table (:data:`mbridge_mxfp8_plugin.probes.defects.DEFECTS`) for the installed
stack, and the hazards it is exposed to (:data:`mbridge_mxfp8_plugin.probes.defects.HAZARDS`: upstream
failures the plugin cannot repair, which ``check`` refuses under the same rule ids). Which are
present is decided in :func:`mbridge_mxfp8_plugin.probes.defects.defects_present` and
:func:`~mbridge_mxfp8_plugin.probes.defects.hazards_exposed` from the installed sources read as text
(megatron-core's param-sync and optimizer files, Megatron-Bridge's training package:
``training/train.py``), never from version strings and without importing torch, megatron-core or
Bridge (importing Bridge needs Transformer Engine). Where nemo_toolkit is installed it also says
where NeMo 2's loop stages, forces syncs and toggles pre-hooks, and each defect in NeMo's terms
(:data:`~mbridge_mxfp8_plugin.probes.defects.NEMO_TERMS`): NeMo 2's LLM stack ends with 2.7, so its
users keep the defects and read the table in NeMo's terms, not Bridge's. nemo_toolkit and Lightning
are found through ``importlib.metadata`` (importing ``nemo`` takes seconds and pulls in torch).
It also says which other owners of the param sync the installed megatron-core ships
(Megatron-FSDP, the LayerWise optimizer) and why a job they own gets no engine, and which installed
packages a ``pip install`` of the plugin (or of anything that resolves Bridge) would replace:
torch, megatron-core, Bridge or Transformer Engine builds of a container that pip's rule rejects
(:mod:`mbridge_mxfp8_plugin.probes.pip_replacements` judges; docs/container.md is the fix).
``--json`` prints the same report machine-readably. Exit codes: 0 the report is complete
(defects present are not an error: they are what the plugin repairs), 2 it could not be made (no
megatron-core installed), with one line on stderr saying so. docs/compatibility.md lists the
result per release pair.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any, TextIO

from ..probes import installed_versions, probe_bridge_files, probe_core_files, probe_hazard_files
from ..probes.defects import (
    DEFECTS,
    HAZARDS,
    NEMO_LAST_RELEASE,
    NEMO_LOOP,
    NEMO_TERMS,
    TRAINING_DEFECTS,
    defects_present,
    hazards_exposed,
)
from ..probes.owners import SyncOwner, probe_owner_files
from ..probes.pip_replacements import pip_replacements
from ..probes.resume import probe_resume_files
from ..probes.versions import package_origin

__all__ = ["add_doctor_parser", "diagnose", "render"]


def _plugin_action(defect: str, present: bool | None, partial: str = "") -> str:
    if present is None:
        return "decided at train start from the megatron-core the job imports"
    if not present:
        return {
            "A": "nothing to repair (offsets checked at on_train_start)",
            "B1": "nothing: core writes forced gathers back",
            "B2": "nothing: the loop stages before every forced sync; the callback stays passive",
            "C": "nothing: core resets the dispatch state when the loop stages",
            "E": "nothing",
            "F": "nothing: the loop keeps the pre-hooks on for the first step after an MXFP8 resume, "
            "or its checkpoint loader re-derives the params",
        }[defect]
    if defect == "B2" and partial == "NeMo 2":
        return (
            "MXFP8ParamSyncLightningCallback stages the main params before each step "
            "(on_megatron_microbatches_start; option stage_for_nemo_steps) and before each save "
            "(on_save_checkpoint), and refreshes the weights at on_validation_start"
        )
    return {
        "A": "rewrites bucket.param_to_index from the buffer's padded layout when it binds (train start)",
        "B1": "writes the gathered weights into the params before eval/test (Bridge on_eval_start, "
        "Lightning on_validation_start, loop API before_eval), before saves and after training",
        "B2": "stages the main params before the loop's forced sync"
        + (f" ({partial})" if partial else "")
        + "; the Bridge callback adds no all-gather, the loop API one per eval",
        "C": "resets param_gather_dispatched when the next step starts and after each eval or save",
        "E": "keeps the loaded weights: marks the bucket groups synced before an eval without an optimizer",
        "F": "re-derives the params from the loaded fp32 main params before the first step after a load "
        "that runs with the pre-hooks off (Bridge on_train_step_start, Lightning on_train_batch_start, "
        "loop API after_load)",
    }[defect]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nemo() -> dict[str, Any] | None:
    """NeMo 2's loop, when nemo_toolkit is installed: its version and whether it still ships the
    LLM stack. Read from the distribution's file list, not by importing ``nemo`` (seconds, and it
    pulls torch and megatron-core); ``llm_stack`` is ``None`` when the list is missing."""
    version = _version("nemo_toolkit")
    if version is None:
        return None
    files = metadata.distribution("nemo_toolkit").files
    llm = None if not files else any(str(f).startswith("nemo/collections/llm/") for f in files)
    return {
        "nemo_toolkit": version,
        "lightning": _version("lightning"),
        "llm_stack": llm,
        "loop": dict(NEMO_LOOP) if llm is not False else None,
        "last_release": NEMO_LAST_RELEASE,
    }


def _versions() -> dict[str, str | None]:
    versions = dict(installed_versions())
    versions["nemo_toolkit"] = _version("nemo_toolkit")
    if _version("pytorch-lightning") is not None:  # NeMo 2 imports lightning.pytorch; list both
        versions["pytorch-lightning"] = _version("pytorch-lightning")
    return versions


def diagnose() -> dict[str, Any]:
    """The report as a dict (what ``--json`` prints)."""
    report: dict[str, Any] = {
        "versions": _versions(),
        "core": None,
        "bridge_loop": None,
        "nemo": _nemo(),
        "defects": {},
    }
    # Bridge's own distribution, Megatron-LM's (after the fold, Bridge #6172), or a source tree
    origin = package_origin("bridge")
    report["bridge_origin"] = origin.as_dict() | {"describe": origin.describe()} if origin else None
    nemo_loop = bool(report["nemo"] and report["nemo"]["loop"])
    loop = probe_bridge_files()
    report["bridge_loop"] = loop.as_dict() if loop else None
    core = probe_core_files()
    report["core"] = core.as_dict() if core else None
    report["hazards"] = _hazards()
    report["owners"] = _owners()
    report["pip"] = [verdict.as_dict() for verdict in pip_replacements()]
    if core is None:
        report["error"] = (
            "megatron-core is not installed (no megatron/core/distributed/param_and_grad_buffer.py): "
            "which of its defects the job will meet is unknown"
        )
    elif not core.has_reuse_knob:
        report["error"] = "megatron-core has no reuse_grad_buf_for_mxfp8_param_ag: nothing to fix"
        return report
    resume = probe_resume_files()
    report["resume"] = resume.as_dict()
    present = defects_present(core, loop, resume)
    partial = ""
    if loop is None and nemo_loop:
        partial = "NeMo 2"
    elif loop is None:
        partial = "no Megatron-Bridge installed: assumed for any loop that does not stage"
    elif present["B2"] and loop.stages_before_eval:
        partial = "the loop stages before evals only; saves and the closing sync are not staged"
    for d, defect in DEFECTS.items():
        report["defects"][d] = {
            "present": present[d],
            "what": defect.symptom,
            "where": defect.where,
            "fixed_in": defect.fixed_in,
            "plugin": _plugin_action(d, present[d], partial if d == "B2" else ""),
        }
        if nemo_loop:
            report["defects"][d]["nemo"] = NEMO_TERMS[d]
    training_defects = [d for d in TRAINING_DEFECTS if present[d]]
    report["present"] = training_defects
    report["unknown"] = [d for d in TRAINING_DEFECTS if present[d] is None]
    if training_defects:
        report["plugin_mode"] = "active"
    elif report["unknown"]:
        report["plugin_mode"] = "decided at train start from the megatron-core the job imports"
    else:
        report["plugin_mode"] = "passive (training); holds weights for eval-only jobs"
    return report


#: Param syncs megatron-core can hand to someone else, and the OwnerFiles flag that says it ships them.
_OWNERS = (("Megatron-FSDP", "megatron_fsdp"), ("the LayerWise distributed optimizer", "layer_wise"))


def _owners() -> dict[str, Any] | None:
    """Which other owners of the param sync the installed megatron-core ships, and why the plugin
    leaves a job they own alone (``None``: no megatron-core to read)."""
    files = probe_owner_files()
    if files is None:
        return None
    shipped = files.as_dict()
    return {name: {"shipped": shipped[flag], "why": SyncOwner(name, "").why} for name, flag in _OWNERS}


def _render_owners(owners: dict[str, Any], p: Any) -> None:
    p("param syncs the plugin leaves to their owner (a job they own: no engine, one line at train start):")
    for name, info in owners.items():
        shipped = "shipped by this megatron-core" if info["shipped"] else "not in this megatron-core"
        p(f"  {name}: {shipped}; {info['why']}")


def _hazards() -> dict[str, Any]:
    """Hazard id -> whether this pair lets a config hit it silently, with the reference and fix."""
    exposed = hazards_exposed(probe_hazard_files())
    return {
        h.id: {
            "exposed": exposed[h.id],
            "title": h.title,
            "what": h.symptom,
            "where": h.where,
            "reference": h.reference,
            "fixed_in": h.fixed_in,
            "fix": h.fix,
        }
        for h in HAZARDS.values()
    }


def _render_hazards(hazards: dict[str, Any], p: Any) -> None:
    p("hazards the plugin cannot repair (check refuses them under these ids):")
    for hid, info in hazards.items():
        if hid == "MX007" and info["exposed"] is False:
            mark = "rejected by megatron-core at config time"
        else:
            mark = {True: "EXPOSED", False: "fixed", None: "unknown (package not installed)"}[info["exposed"]]
        p(f"  {hid} {info['title']}: {mark}")
        if info["exposed"] is not False:
            p(f"        {info['what']}")
        p(f"        upstream: {info['reference']}; fixed in: {info['fixed_in']}")
        if info["exposed"] is not False:
            p("        avoid with: " + info["fix"].replace("\n", "\n                    "))
    listed = [hid for hid, info in hazards.items() if info["exposed"]]
    p(f"hazards exposed: {', '.join(listed) or 'none'}")


def render(report: dict[str, Any], out: TextIO = sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("mxfp8-plugin doctor")
    p("installed:")
    for name, ver in report["versions"].items():
        p(f"  {name:<20} {ver or '-'}")
    if report.get("bridge_origin"):
        p(f"  {'megatron.bridge':<20} {report['bridge_origin']['describe']}")  # where it comes from
    if report.get("pip"):
        _render_pip(report["pip"], p)
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
        keeps = (report.get("resume") or {}).get("keeps_prehooks_on_mxfp8_resume")
        p(f"  keeps the pre-hooks on for an MXFP8 resume (F):    {keeps}")
    else:
        p("Megatron-Bridge: not installed (B2 judged for a loop that does not stage)")
    if report.get("nemo"):
        _render_nemo(report["nemo"], p)
    if report.get("error"):
        p(f"error: {report['error']}")
    if report["defects"]:
        _render_defects(report, p)
    if report.get("hazards"):
        _render_hazards(report["hazards"], p)
    if report.get("owners"):
        _render_owners(report["owners"], p)


#: replacement lines and not-installed names shown per install; --json has them all
_PIP_SHOWN = 8


def _render_pip(verdicts: list[dict[str, Any]], p: Any) -> None:
    p("pip (the installed requirements, judged by pip's rule for an installed version):")
    for v in verdicts:
        if v["status"] == "keeps":
            p(f"  {v['scope']}: keeps every installed package ({v['checked']} requirements checked)")
            continue
        replaced = list(dict.fromkeys(r["package"] for r in v["replacements"]))
        head = f"REPLACES {', '.join(replaced)}" if replaced else "unchecked"
        p(f"  {v['scope']}: {head}")
        for r in v["replacements"][:_PIP_SHOWN]:
            p(f"    {r['line']}")
        if v["replacements"][_PIP_SHOWN:]:
            p(f"    and {len(v['replacements']) - _PIP_SHOWN} more (--json lists them)")
        for reason in v["unchecked"]:
            p(f"    unchecked: {reason}")
        if v["added"]:
            more = len(v["added"]) - _PIP_SHOWN
            shown = ", ".join(v["added"][:_PIP_SHOWN]) + (f" and {more} more" if more > 0 else "")
            p(f"    not installed, pip adds an index release (its requirements unread): {shown}")
        if v["fix"]:
            p(f"    fix: {v['fix']}")


def _render_nemo(nemo: dict[str, Any], p: Any) -> None:
    if nemo["llm_stack"] is False:
        p(f"nemo_toolkit {nemo['nemo_toolkit']}: NeMo Speech, no NeMo 2 LLM stack (nemo.collections.llm)")
        p(f"  {nemo['last_release']}")
        return
    unsure = "" if nemo["llm_stack"] else " (its file list is missing: assumed to be NeMo 2's)"
    p(
        f"NeMo 2 loop (nemo_toolkit {nemo['nemo_toolkit']}, nemo.lightning){unsure}; "
        "the fix: MXFP8ParamSyncLightningCallback (mbridge_mxfp8_plugin.lightning)"
    )
    for question, answer in nemo["loop"].items():
        p(f"  {question}: {answer}")
    p(f"  {nemo['last_release']}")


def _render_defects(report: dict[str, Any], p: Any) -> None:
    p("defects (MXFP8 params + fp8_param_gather + reuse_grad_buf_for_mxfp8_param_ag + overlap_param_gather):")
    for d, info in report["defects"].items():
        mark = {True: "PRESENT", False: "fixed  ", None: "unknown"}[info["present"]]
        p(f"  {d:<3} {mark}  {info['what']}")
        p(f"               where: {info['where']}; fixed upstream in: {info['fixed_in']}")
        if "nemo" in info:
            p(f"               in NeMo 2: {info['nemo']}")
        p(f"               plugin: {info['plugin']}")
    listed = ", ".join(report["present"])
    if report["unknown"]:  # unknown is never "none"
        unknown = f"unknown (no megatron-core to read): {', '.join(report['unknown'])}"
        listed = f"{listed}; {unknown}" if listed else unknown
    listed = listed or "none"
    p(f"training defects present: {listed}; plugin mode: {report['plugin_mode']}")


def _cmd_doctor(args: argparse.Namespace) -> int:
    report = diagnose()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        render(report)
    if report.get("core") is None:  # no megatron-core: which defects apply is unknown, not "none"
        reason = report.get("error", "megatron-core not found")
        print(f"mxfp8-plugin doctor: error: {reason}; pip install megatron-core", file=sys.stderr)
        return 2
    return 0


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="installed versions, which MXFP8 param-gather defects they have, what the plugin does "
        "(exit 0 report made, 2 no megatron-core to inspect)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_cmd_doctor)
    return parser
