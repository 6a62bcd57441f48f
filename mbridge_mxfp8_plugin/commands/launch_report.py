"""What ``python -m mbridge_mxfp8_plugin.launch --dry-run`` prints: the job a run would start.

The job is built exactly as for a run (:func:`.launch.prepare`: recipe function, file, overrides,
plugin section, Bridge's own merge); then, instead of training, the train-start config check runs
on the built ``ConfigContainer`` (the rules that need no model: the callback runs the same
``validate_config`` call at ``on_train_start``, before it looks at model chunks) and the plugin's
options and the MXFP8 knobs are printed as the job will use them. The knobs are shown after
Bridge's own precedence (``mixed_precision`` owns the fp8 knobs, ``comm_overlap`` the overlap
ones: :class:`.config.effective.EffectiveConfig`), since the container's raw fields are
overwritten inside ``pretrain()`` and would mislead.
"""

from __future__ import annotations

from typing import Any, TextIO

from ..common.exit_codes import EXIT_OK, EXIT_REFUSED
from ..common.yamltypes import yaml_literal

__all__ = ["dry_run"]

#: (section, knob) shown, in the order a reader checks the MXFP8 param-gather combination.
KNOBS = (
    ("ddp", "use_distributed_optimizer"),
    ("ddp", "overlap_grad_reduce"),
    ("ddp", "overlap_param_gather"),
    ("ddp", "fp8_param_gather"),
    ("ddp", "reuse_grad_buf_for_mxfp8_param_ag"),
    ("ddp", "align_param_gather"),
    ("ddp", "bucket_size"),
    ("optimizer", "use_distributed_optimizer"),
    ("optimizer", "overlap_param_gather"),
    ("optimizer", "reuse_grad_buf_for_mxfp8_param_ag"),
)


def _value(v: Any) -> str:
    return yaml_literal(v.value) if v.known else "unknown"


def knob_lines(config: Any, options: Any, dp_size: int | None) -> list[str]:
    """``name  value  (where it comes from)`` for the fp8 recipe and each of :data:`KNOBS`."""
    from ..config.effective import EffectiveConfig
    from ..config.view import read_config

    eff = EffectiveConfig(read_config(config, plugin=options), dp_size, None)
    rows = [("fp8 recipe", eff.fp8_recipe()), ("params kept in fp8", eff.fp8_params())]
    rows += [(f"{s}.{k}", eff.ddp(k) if s == "ddp" else eff.opt(k)) for s, k in KNOBS]
    width = max(len(name) for name, _ in rows)
    return [f"  {name.ljust(width)}  {_value(v)}  (from {v.path})" for name, v in rows]


def _render(launch: Any, report: Any, refused: bool) -> str:
    options = launch.options
    out = [f"dry run: {launch.summary}; nothing trained", "", "plugin options (mxfp8_plugin):"]
    out += [f"  {name}: {yaml_literal(value)}" for name, value in options.as_mapping().items()]
    callback = "none (mxfp8_plugin.enabled is false)"
    if launch.callbacks:
        callback = "MXFP8ParamSyncCallback" + (
            "" if options.enabled else " (enabled false: it checks the weights only)"
        )
    out += ["", f"callbacks added to {launch.mode}(): {callback}", ""]
    out += ["MXFP8 knobs the job runs with (after Bridge's mixed_precision / comm_overlap precedence):"]
    out += knob_lines(launch.config, options, report.dp_size)
    findings = launch.file_report.findings if launch.file_report is not None else []
    if findings:
        out += ["", "check, on the file and overrides (what the recipe function set taken into account):"]
        out += [f"  {f.line()}" for f in findings]
    out += ["", "train-start config check, on the built ConfigContainer (the rules that need no model):"]
    out += [report.format_table()]
    if not options.enabled:
        out.append("note: mxfp8_plugin.enabled is false, so a run adds no callback and skips this check")
    elif not options.validate:
        out.append("note: mxfp8_plugin.validate is false, so a run skips this check")
    elif not report.ok or launch.file_report is not None and launch.file_report.errors:
        how = "refuse to start" if options.strict else "log these errors and train (strict: false)"
        out.append(f"note: with these options a run would {how}")
    out += [
        "",
        "verdict: " + ("the train-start check would refuse this job" if refused else "the job would start"),
    ]
    return "\n".join(out) + "\n"


def dry_run(launch: Any, out: TextIO | None) -> int:
    """Judge and print ``launch`` (a :class:`.launch.Launch`; typed ``Any`` since launch stands above
    this module); print nothing where ``out`` is None (ranks other than 0). Returns 1 when a run
    would be refused at train start, else 0."""
    from ..config.validate import validate_config

    report = validate_config(launch.config, plugin=launch.options, strict=False)
    refused = bool(launch.file_refusal()) or (launch.refuses_on_errors() and not report.ok)
    if out is not None:
        out.write(_render(launch, report, refused))
    return EXIT_REFUSED if refused else EXIT_OK
