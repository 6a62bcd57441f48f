"""Render the numbers and lists the docs repeat from their one source, between marker comments.

Each block of a doc that repeats something kept elsewhere (the plugin's options, the defect and
hazard tables, the loop API's calls, the GPU benchmark's figures) sits between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` and is written here from its source:
``PluginOptions``' field docstrings (``options.py``), ``defects.py``, ``adapters/loop.py``'s docstring,
and the committed benchmark results (:data:`RESULTS`). Only the text between markers is touched,
so the prose around a block stays its author's.

    python docs/render.py           # exit 1 and name each block that differs from its source,
                                    # and each statement that contradicts a source or a page
    python docs/render.py --write   # rewrite those blocks

What no block can hold (a list or number a page states in its own words: a recipe name, an option,
an exit status, a release pair's defects, a test count) is checked by :data:`CHECKS`.
``tests/unit/test_docs.py`` runs the drift check and ``tests/unit/test_docs_agree.py`` the
contradiction checks, so a doc and its source cannot disagree in CI.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbridge_mxfp8_plugin.options import PluginOptions, option_docs  # noqa: E402
from mbridge_mxfp8_plugin.probes.defects import DEFECTS, HAZARDS  # noqa: E402

#: The GPU run the docs quote (``benchmarks/run_gpu.sh`` on 2 x H200, both passes); a new run is
#: a new folder, and pointing this at it re-renders every figure.
RESULTS = ROOT / "benchmarks" / "results" / "h200x2_verify" / "eval_sync.json"

_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _rst_to_md(text: str) -> str:
    # :func:`~pkg.verify_weights` -> `verify_weights()`, :class:`~pkg.X` -> `X`, ``x`` -> `x`
    text = re.sub(r":func:`~?(?:[\w.]+\.)?(\w+)`", r"`\1()`", text)
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    return text.replace("``", "`")


def _yaml_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _defaults() -> dict[str, Any]:
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(PluginOptions)}


def options_yaml() -> str:
    """Every option with its default, as the ``mxfp8_plugin:`` section of a recipe."""
    defaults = _defaults()
    width = max(len(n) for n in defaults) + 2
    lines = [f"  {f'{n}:':<{width}}{_yaml_value(v)}" for n, v in defaults.items()]
    return "```yaml\nmxfp8_plugin:\n" + "\n".join(lines) + "\n```\n"


def options_list() -> str:
    """Every option, its default and its field docstring."""
    defaults, docs = _defaults(), option_docs()
    return "".join(
        f"- `{n}` (default `{_yaml_value(v)}`): {_rst_to_md(docs[n])}\n" for n, v in defaults.items()
    )


def defects_table() -> str:
    rows = [f"| **{d.id}** | {d.symptom} | {d.fixed_in} |" for d in DEFECTS.values()]
    head = "| id | what goes wrong | fixed upstream in |\n|----|-----------------|-------------------|\n"
    return head + "\n".join(rows) + "\n"


def hazards_table() -> str:
    rows = [f"| {h.id} | {h.title} | {h.fixed_in} |" for h in HAZARDS.values()]
    head = "| rule | hazard | fixed upstream in |\n|------|--------|-------------------|\n"
    return head + "\n".join(rows) + "\n"


#: A call of the loop API in a code line: ``sync = mxfp8_param_sync(...)`` (the constructor),
#: ``sync.NAME(`` or ``mxfp8_param_sync(...).NAME(``.
_API_CALL = re.compile(r"^\s*sync = (mxfp8_param_sync)\(|(?:\bsync|\bmxfp8_param_sync\([^()]*\))\.(\w+)\(")


def api_calls_in(code: str) -> list[str]:
    """The loop-API calls a code block makes, in order (comments dropped)."""
    calls = []
    for line in code.splitlines():
        for m in _API_CALL.finditer(line.split("#", 1)[0]):
            calls.append(m.group(1) or m.group(2))
    return calls


def api_example() -> str:
    """The example block of ``adapters/loop.py``'s docstring: the lines a loop adds, the one source."""
    doc = ast.get_docstring(ast.parse((ROOT / "mbridge_mxfp8_plugin" / "adapters" / "loop.py").read_text()))
    assert doc and "::\n" in doc, "api.py's docstring has no example block"
    return doc.split("::\n", 1)[1].split("\n\n``", 1)[0]


def api_example_block() -> str:
    """api.py's example as a Markdown code block."""
    import textwrap

    return "```python\n" + textwrap.dedent(api_example()).strip("\n") + "\n```\n"


def api_calls() -> str:
    """How many calls api.py's example adds to a loop, in words."""
    return _WORDS[len(api_calls_in(api_example()))]


# --------------------------------------------------------------------------- benchmark figures
def _results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text())


def _rows(size: str) -> list[dict[str, Any]]:
    return [next(r for r in p["rows"] if r["size"] == size) for p in _results()["passes"]]


def _col(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r[key] for r in rows]


def _ms(values: list[float]) -> str:
    return " / ".join(f"{v * 1e3:.1f}" for v in values) + " ms"


def _ratios(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _span(values: list[float], digits: int = 1) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def eval_table() -> str:
    """The eval transition, one-pass quantizer: one row per model size, pass 1 / pass 2."""
    out = [
        "| model | plugin, core 0.16.1 | native, core 0.19.2 | plugin / native | physical floor "
        "| plugin / floor | raw all-gather | core's forced gather | all-gathers (plugin / native) |",
        "|------:|------:|------:|------:|------:|------:|------:|------:|------:|",
    ]
    for size in ("1B", "4B"):
        rows = _rows(size)

        def col(key: str, rows: list[dict[str, Any]] = rows) -> list[Any]:
            return _col(rows, key)

        out.append(
            f"| {size} | {_ms(col('plugin_prestaged_plainquant_s'))} "
            f"| {_ms(col('native_0192_plainquant_s'))} "
            f"| **{_ratios(col('ratio_plugin_vs_native'))}** | {_ms(col('floor_s'))} "
            f"| **{_ratios(col('ratio_plugin_vs_floor'))}** | {_ms(col('raw_allgather_s'))} "
            f"| {_ms(col('framework_forced_sync_s'))} "
            f"| {rows[0]['plugin_prestaged_allgathers']} / {rows[0]['native_allgathers']} |"
        )
    return "\n".join(out) + "\n"


def _mib(values: list[int]) -> str:
    return " / ".join(f"{v / 2**20:.0f}" for v in values) + " MiB"


def _old_verifier_check(name: str) -> bool:
    """A target of :data:`RESULTS` about the verifier: that run measured it before ``verify/``
    (no plans, no CUDA graphs, no fused kernel), so its figures no longer describe it."""
    return "verif" in name


def targets_table() -> str:
    """Every eval-transition target the benchmark checks, with each pass's value and verdict (its
    verifier targets left out: the verifier's cost has one home, docs/verify.md)."""
    passes = _results()["passes"]
    names = [
        n
        for n in dict.fromkeys(c["check"] for p in passes for c in p["checks"])
        if not _old_verifier_check(n)
    ]
    out = [
        "| target | " + " | ".join(f"pass {i + 1}" for i in range(len(passes))) + " |",
        "|---|" + "---|" * len(passes),
    ]
    for name in names:
        cells = []
        for p in passes:
            c = next((c for c in p["checks"] if c["check"] == name), None)
            value = "" if c is None else c["value"]
            shown = f"{value:.2f}" if isinstance(value, float) and value % 1 else str(value)
            cells.append("not run" if c is None else f"{'pass' if c['pass'] else '**MISS**'} ({shown})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def emulated_ratio() -> str:
    """Plugin / native with the emulated quantizer (both sides dominated by it), over sizes and passes."""
    return _span([r["ratio_plugin_vs_native_emulated"] for s in ("1B", "4B") for r in _rows(s)], 2)


def hooks_us() -> str:
    """Host time of the plugin's hooks on a training step without a forced sync."""
    return _span([r["hooks_per_plain_step_us"] for s in ("1B", "4B") for r in _rows(s)], 0) + " us"


def host_refresh() -> str:
    """Host time per parameter (10k small params): whole refresh, and its parts."""
    host = next(p["host"] for p in _results()["passes"] if p.get("host"))
    us = {k: v * 1e6 for k, v in host.items() if k.endswith("_s")}
    return (
        f"whole refresh {us['refresh_per_param_s']:.1f} us per param, of which megatron-core's staging "
        f"{us['core_staging_per_param_s']:.2f} us and the plugin's write-back loop "
        f"{us['engine_loop_per_param_s']:.2f} us ({host['params']} params)"
    )


def plugin_full() -> str:
    """The loop API's full refresh on core 0.16.1 (stage + gather + write-back), per size."""
    return ", ".join(f"{_ms([r['plugin_full_plainquant_s'] for r in _rows(s)])} at {s}" for s in ("1B", "4B"))


def recipe_names() -> str:
    """The recipes the package ships (checkout and wheel alike)."""
    from mbridge_mxfp8_plugin.config.recipe_files import shipped_recipes

    return ", ".join(f"`{name}`" for name in shipped_recipes())


# --------------------------------------------------------------------- defects per release pair
#: A release number standing alone (not ``core_v0.19.2``, not ``#3007``).
_VERSION = re.compile(r"(?<![\w.])(\d+)\.(\d+)(?:\.(\d+))?(?![\w.])")


def version(text: str) -> tuple[int, int, int]:
    """``"0.19.2"`` / ``"0.19"`` -> ``(0, 19, 2)`` / ``(0, 19, 0)``."""
    m = _VERSION.search(text)
    if not m:
        raise ValueError(f"no release number in {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def fixed_by(defect_id: str) -> tuple[str, list[tuple[int, int, int]]]:
    """The package whose release fixes the defect and the releases its ``fixed_in`` names for it
    (B2: the first fixes evals, the last every forced sync); ``("", [])``: not fixed upstream.
    Read from ``DEFECTS[id].fixed_in``, the one statement of which release fixed what."""
    text = DEFECTS[defect_id].fixed_in
    m = re.match(r"megatron-(core|bridge) ", text, re.I)
    if not m:
        return "", []
    own = re.split(r"\(with |;|megatron-(?:core|bridge)|megatron-lm", text[m.end() :], flags=re.I)[0]
    found = [version(v.group(0)) for v in _VERSION.finditer(own)]
    return m.group(1).lower(), found


def pair_defects(core: str, bridge: str) -> dict[str, bool | None]:
    """Every defect -> present with this megatron-core release under this Megatron-Bridge
    release's loop: ``defects_present`` (what ``doctor`` decides from probes) fed with the
    behaviours each release has by ``fixed_in``."""
    from types import SimpleNamespace

    from mbridge_mxfp8_plugin.probes.defects import core_defects, defects_present

    have = {"core": version(core), "bridge": version(bridge)}
    core_side = set(core_defects(None))

    def fixed(defect_id: str, *, first: bool = False) -> bool:
        package, releases = fixed_by(defect_id)
        if not releases:
            return False
        if package != ("core" if defect_id in core_side else "bridge"):
            raise ValueError(f"defect {defect_id} is fixed in megatron-{package}, not where its probe looks")
        return have[package] >= (min(releases) if first else max(releases))

    core_probe = SimpleNamespace(
        pads_bucket_offsets=fixed("A"), forced_sync_writes_back=fixed("B1"), has_dispatch_reset=fixed("C")
    )
    loop = SimpleNamespace(
        stages_before_eval=fixed("B2", first=True), stages_before_every_forced_sync=fixed("B2")
    )
    return defects_present(core_probe, loop, SimpleNamespace(loop_fixes_f=fixed("F")))


def release_pairs() -> list[tuple[str, str, str]]:
    """(megatron-core, Megatron-Bridge, Python) of every release-pair cell CI installs
    (``requirements/core*.txt``, one per ``.ci/matrix.sh`` cell), oldest first."""
    pairs = []
    for req in (ROOT / "requirements").glob("core*.txt"):
        text = req.read_text(encoding="utf-8")
        core = re.search(r"^megatron-core==(\S+)", text, re.M)
        bridge = re.search(r"^megatron-bridge==(\S+)", text, re.M)
        python = re.search(r"on Python (3\.\d+)", text)
        if core and bridge and python:
            pairs.append((core.group(1), bridge.group(1), python.group(1)))
    return sorted(pairs, key=lambda p: version(p[0]))


def _ids(present: dict[str, bool | None], ids: tuple[str, ...]) -> str:
    return ", ".join(d for d in ids if present[d]) or "none"


def release_table() -> str:
    """Which defects each tested release pair has: doctor's verdict, from ``fixed_in``."""
    from mbridge_mxfp8_plugin.probes.defects import TRAINING_DEFECTS

    out = [
        "| megatron-core | Megatron-Bridge | Python | training defects (doctor) "
        "| E: eval-only jobs | F: first step after a resume |",
        "|---|---|---|---|---|---|",
    ]
    for core, bridge, python in release_pairs():
        p = pair_defects(core, bridge)
        mark = {True: "present", False: "fixed", None: "unknown"}
        training = _ids(p, TRAINING_DEFECTS)
        out.append(f"| {core} | {bridge} | {python} | {training} | {mark[p['E']]} | {mark[p['F']]} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ the CLI
def check_options() -> str:
    """Every option of ``mxfp8-plugin check``, as its parser defines it."""
    import argparse

    from mbridge_mxfp8_plugin.commands.cli import build_parser

    parser = build_parser("check")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["check"]
    formatter = sub._get_formatter()
    lines = []
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = " ".join((action.help or "").split()) % {"default": action.default}
        lines.append(f"- `{formatter._format_action_invocation(action)}`: {text}")
    return "\n".join(lines) + "\n"


def exit_codes() -> str:
    """The exit statuses every command shares (``common/exit_codes.py``)."""
    from mbridge_mxfp8_plugin.common.exit_codes import TABLE

    return "| exit | meaning |\n|---:|---|\n" + "".join(f"| {c} | {m} |\n" for c, m in sorted(TABLE.items()))


#: ``mxfp8-plugin check``'s cost (``benchmarks/check_speed.py``).
CHECK_SPEED = ROOT / "benchmarks" / "results" / "check_speed.json"


def check_speed() -> str:
    """check's cost as a ratio to its floor (``import omegaconf, yaml``), measured side by side."""
    r = json.loads(CHECK_SPEED.read_text())
    ratio = r["ratio_to_floor"]
    load = "-".join(f"{v:g}" for v in r["loadavg_1m_before_after"])
    return (
        f"**{ratio['check']['wall']:.2f}x** the floor for a recipe "
        f"({ratio['check']['cpu']:.2f}x in CPU time), "
        f"{ratio['check_with_overrides']['wall']:.2f}x with `key=value` overrides (Hydra's parser), "
        f"{ratio['check_no_summary_cache']['wall']:.2f}x without the source-summary cache, "
        f"{ratio['check_with_teardown']['wall']:.2f}x if it ended in a normal interpreter exit (its "
        f"module teardown, which `check` skips when nothing waits for it); the goal is {r['goal_ratio']:g}x, "
        f"{'met' if ratio['check']['wall'] <= r['goal_ratio'] else 'not met'} "
        f'(the floor, `python -c "import omegaconf, yaml"`, took '
        f"{r['floor']['median_s'] * 1000:.0f} ms here; median of {r['rounds']} rotated rounds; "
        f"{r['cpus']} CPUs at load average {load}; {r['date']})"
    )


#: The weight verifier's run (``benchmarks/eval_sync.py verify``, 1 x H200, the TE-shaped type);
#: every verifier figure of the docs comes from it, rendered into docs/verify.md only.
#: The last run over both sizes and releases on an H200, and the latest run of the current code (both
#: sizes and releases, on an H100).
VERIFY_RESULTS = ROOT / "benchmarks" / "results" / "verify_te" / "verify_te.json"
VERIFY_LATEST = ROOT / "benchmarks" / "results" / "verify_te_startup" / "verify_te.json"


def _verify_rows(results: Path = VERIFY_LATEST) -> list[dict[str, Any]]:
    return json.loads(results.read_text())["rows"]


def _xspan(values: list[float]) -> str:
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


#: benchmarks/verify_te.py's paths, as the docs name them
_VERIFY_PATHS = {
    "fused": "TE's rule, fused kernel",
    "own": "TE's rule, the type's own write (TE-rule kernel off)",
    "other": "another rule, the type's own write",
}


def _path_rows(path: str, size: str | None = None, results: Path = VERIFY_LATEST) -> list[dict[str, Any]]:
    rows = _verify_rows(results)
    return [r for r in rows if r["path"] == path and (size is None or r["size"] == size)]


def verify_te_table() -> str:
    """The last run over both sizes and releases (see :func:`_verify_table`)."""
    return _verify_table(json.loads(VERIFY_RESULTS.read_text()))


def verify_te_latest() -> str:
    """The latest run of the current code (see :func:`_verify_table`)."""
    return _verify_table(json.loads(VERIFY_LATEST.read_text()))


def _verify_table(result: dict[str, Any]) -> str:
    """Per size, megatron-core release and path: each call kind as a multiple of the eval
    transition of the same process (the path's own cast; the one-pass cast for the fused kernel)."""
    out = [
        "| model | core | path | eval transition | sampled: first call | sampled: first of a job, "
        "kernels compiled | sampled: evals after the train-start warm-up (max) | sampled: steady "
        "| 1/64: steady | sampled / full | full: first call | full: first of a job, kernels compiled "
        "| full: evals after warm-up (max) | full: steady | graphs | extra peak |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        graphs = "replayed" if r["s16_graphs"] and r["full_graphs"] else "eager"
        peak = max(r[f"{k}_peak_extra_bytes"] for k in ("s16", "s64", "full"))
        out.append(
            f"| {r['size']} | {r['core']} | {_VERIFY_PATHS[r['path']]} "
            f"| {r['eval_s'] * 1e3:.1f} ms ({r['eval_against']}) | {r['s16_first_x']:.2f} "
            f"| {r['s16_warm_x']:.2f} | **{r['s16_after_warm_max_x']:.2f}** "
            f"| {r['s16_steady_x']:.2f} ({r['s16_steady_s'] * 1e3:.1f} ms) | {r['s64_steady_x']:.2f} "
            f"| {r['s16_vs_full']:.3f} | {r['full_first_x']:.2f} | {r['full_warm_x']:.2f} "
            f"| **{r['full_after_warm_max_x']:.2f}** | {r['full_steady_x']:.2f} | {graphs} "
            f"| {peak / 2**20:.0f} MiB |"
        )
    out += ["", *_verify_targets(result["checks"])]
    return "\n".join(out) + "\n"


def _verify_targets(checks: list[tuple[str, bool]]) -> list[str]:
    """Issue 32's targets as the run judged them: per target and path, the cases that pass (of
    sizes x releases; the fused kernel's only where its probe took the type)."""
    tally: dict[str, dict[str, list[int]]] = {}
    for name, ok in checks:
        case, target = name.split(": ", 1)
        path = case.rsplit(" ", 1)[-1]
        cell = tally.setdefault(target, {}).setdefault(path, [0, 0])
        cell[0] += bool(ok)
        cell[1] += 1
    passed = sum(ok for _, ok in checks)
    out = [
        f"Issue 32's targets as the run judged them, every call from the job's second on (the first "
        f"includes the plan and its recording, which the plugin makes at train start): {passed} of "
        f"{len(checks)} cases pass. Cases passing, per target and path:",
        "",
        "| target | " + " | ".join(_VERIFY_PATHS[p] for p in _VERIFY_PATHS) + " |",
        "|---|" + "---:|" * len(_VERIFY_PATHS),
    ]
    for target, paths in tally.items():
        cells = [f"{paths[p][0]} / {paths[p][1]}" if p in paths else "-" for p in _VERIFY_PATHS]
        out.append(f"| {target} | " + " | ".join(cells) + " |")
    return out


def verify_te_ratio() -> str:
    """The 4B steady ratios of the verifier run, per path, as a sentence fragment."""

    def span(path: str, key: str) -> str:
        return _xspan([r[key] for r in _path_rows(path, "4B")])

    return (
        f"sampled {span('fused', 's16_steady_x')}x, full {span('fused', 'full_steady_x')}x an eval "
        f"transition at 4B with TE's rule (fused kernel; against the one-pass cast); through the type's "
        f"own write: sampled {span('own', 's16_steady_x')}x, full {span('own', 'full_steady_x')}x "
        f"(TE's rule), sampled {span('other', 's16_steady_x')}x, full {span('other', 'full_steady_x')}x "
        f"(another rule)"
    )


#: ``benchmarks/plan_tables.py``'s side-by-side run of a plan's tables on the host.
PLAN_TABLES = ROOT / "benchmarks" / "results" / "plan_tables" / "plan_tables.json"


def plan_tables() -> str:
    """Per case, the run's now / before ratios (their span over the rounds) and the batches."""
    cases = json.loads(PLAN_TABLES.read_text())["cases"]
    return ", ".join(
        f"{_xspan(case['now_over_before'])}x at {case['batches']:,} batches" for case in cases.values()
    )


#: ``benchmarks/replay_head.py``'s side-by-side run of a replayed check's host time.
REPLAY_HEAD = ROOT / "benchmarks" / "results" / "replay_head" / "replay_head.json"
FIRST_CALL = ROOT / "benchmarks" / "results" / "first_call" / "first_call.json"


def _sides(path: Path, parts: dict[str, str], scale: float, unit: str) -> str:
    """A side-by-side run (``benchmarks/_job.sides_of_parts``): per part, each side's median over
    the rounds, and the ratio's median and span per round."""
    run = json.loads(path.read_text())

    def part(key: str, what: str) -> str:
        seen = run[key]
        before, now = (statistics.median(seen[side]) * scale for side in ("before", "now"))
        ratio = statistics.median(seen["now_over_before"])
        span = _xspan(seen["now_over_before"])
        return f"{what} {before:.1f} -> {now:.1f} {unit} ({ratio:.2f}x; {span}x per round)"

    rounds = len(run[next(iter(parts))]["now"])
    return ", ".join(part(k, w) for k, w in parts.items()) + f", {rounds} rounds against {run['before']}"


def replay_head() -> str:
    """The host's work before a replayed check's launch and in all."""
    return _sides(REPLAY_HEAD, {"head_s": "before the launch", "total_s": "in all"}, 1e6, "us")


def first_call() -> str:
    """A job's first fused check's host time, sampled and full."""
    return _sides(FIRST_CALL, {"s16_s": "1/16", "full_s": "full"}, 1e3, "ms")


def verify_sampled_vs_full() -> str:
    """What the sampled check costs next to the full one in the latest run, per path (three
    decimals: the target is 0.1)."""

    def span(path: str) -> str:
        values = [r["s16_vs_full"] for r in _path_rows(path)]
        lo, hi = f"{min(values):.3f}", f"{max(values):.3f}"
        return lo if lo == hi else f"{lo}-{hi}"

    return ", ".join(f"{span(p)} ({_VERIFY_PATHS[p]})" for p in _VERIFY_PATHS)


def verify_first_call() -> str:
    """The first check of a process, which compiles (or loads) the fused kernel, per release run."""
    firsts = [r["s16_first_s"] for r in _path_rows("fused", "1B", VERIFY_RESULTS)]
    return f"{_span(firsts)} s"


def verify_sampled_ms() -> str:
    """The sampled check's steady-state time at 4B, per path, over the releases."""
    return ", ".join(
        f"{_span([1e3 * r['s16_steady_s'] for r in _path_rows(p, '4B')])} ms ({_VERIFY_PATHS[p]})"
        for p in _VERIFY_PATHS
    )


def verify_peak() -> str:
    """The extra peak memory of a check (any sample) in the run, per path."""

    def mib(path: str) -> str:
        peaks = [r[f"{k}_peak_extra_bytes"] / 2**20 for r in _path_rows(path) for k in ("s16", "s64", "full")]
        return _span(peaks, 0) + " MiB"

    return ", ".join(f"{mib(p)} ({_VERIFY_PATHS[p]})" for p in _VERIFY_PATHS)


def layering_tables(source: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """``LAYERS`` and ``SAME_LAYER_OK`` as written in ``tests/unit/test_layering.py``'s source."""
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in ("LAYERS", "SAME_LAYER_OK") and node.value:
            found[target.id] = ast.literal_eval(node.value)
    return found["LAYERS"], tuple(found["SAME_LAYER_OK"])


def layers_table(source: str | None = None) -> str:
    """The import layers ``tests/unit/test_layering.py`` enforces, lowest first."""
    layers, same = layering_tables(source or (ROOT / "tests" / "unit" / "test_layering.py").read_text())
    by_layer: dict[int, list[str]] = {}
    for module, layer in layers.items():
        by_layer.setdefault(layer, []).append(module)
    rows = ["| layer | modules (a package: every module under it) | imports allowed from |", "|---:|---|---|"]
    for layer in sorted(by_layer):
        pkg = ROOT / "mbridge_mxfp8_plugin"
        names = ", ".join(f"`{m}/`" if (pkg / m).is_dir() else f"`{m}`" for m in sorted(by_layer[layer]))
        inside = sorted(m for m in by_layer[layer] if m in same)
        allowed = f"layers < {layer}" if layer else "nothing of the package"
        if inside:
            allowed += "; inside " + ", ".join(f"`{m}/`" for m in inside) + " also its own layer"
        rows.append(f"| {layer} | {names} | {allowed} |")
    return "\n".join(rows) + "\n"


#: doc -> block name -> renderer. Inline blocks (a number inside a sentence) end without "\n".
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {
        "defects": defects_table,
        "hazards": hazards_table,
        "release-defects": release_table,
        "options": options_yaml,
        "api-calls": api_calls,
        "recipes": recipe_names,
    },
    "docs/compatibility.md": {"release-defects": release_table},
    "docs/launch.md": {"options": options_list},
    "docs/megatron-lm.md": {"api-calls": api_calls, "api-example": api_example_block},
    "docs/performance.md": {
        "eval-table": eval_table,
        "targets": targets_table,
        "emulated-ratio": emulated_ratio,
        "hooks-us": hooks_us,
        "host-refresh": host_refresh,
        "plugin-full": plugin_full,
    },
    "docs/verify.md": {
        "verify-te-table": verify_te_table,
        "verify-te-latest": verify_te_latest,
        "verify-te-ratio": verify_te_ratio,
        "verify-sampled-vs-full": verify_sampled_vs_full,
        "verify-first-call": verify_first_call,
        "verify-sampled-ms": verify_sampled_ms,
        "verify-peak": verify_peak,
        "plan-tables": plan_tables,
        "replay-head": replay_head,
        "first-call": first_call,
    },
    "docs/layout.md": {"layers": layers_table},
    "docs/check.md": {
        "check-speed": check_speed,
        "recipes": recipe_names,
        "check-options": check_options,
        "exit-codes": exit_codes,
    },
}

#: Renderers whose figures have one page: rendered anywhere else, they would be a second statement
#: of a cost that page owns (the verifier's: docs/verify.md; check's: docs/check.md).
HOMES: dict[Callable[[], str], str] = {
    **{make: "docs/verify.md" for make in BLOCKS["docs/verify.md"].values()},
    check_speed: "docs/check.md",
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->\n?)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)


def render(text: str, blocks: dict[str, Callable[[], str]]) -> tuple[str, list[str]]:
    """``text`` with every block re-rendered, and the names of blocks missing from it."""
    missing = []
    for name, make in blocks.items():
        pattern = _pattern(name)
        if not pattern.search(text):
            missing.append(name)
            continue
        body = make()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(3), text)
    return text, missing


def drift() -> list[str]:
    """One line per doc block that is missing or differs from its source; empty when all agree."""
    problems = []
    for doc, blocks in BLOCKS.items():
        path = ROOT / doc
        text = path.read_text(encoding="utf-8")
        new, missing = render(text, blocks)
        problems += [f"{doc}: no <!-- {name}:begin/end --> block" for name in missing]
        for name in blocks:
            old_m, new_m = _pattern(name).search(text), _pattern(name).search(new)
            if old_m and new_m and old_m.group(2) != new_m.group(2):
                problems.append(f"{doc}: block {name!r} differs from its source")
    return problems


# ------------------------------------------------------------------ contradictions between pages
# What a block cannot hold: a list or number a page states in its own words. Each check reads every
# page (README.md, docs/*.md) and names each statement that differs from its source or from
# another page; ``tests/unit/test_docs_agree.py`` runs them and shows that each one can fail.


def pages() -> dict[str, str]:
    """Every page a user reads: path relative to the repository -> text."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}


def _prose(text: str) -> str:
    """``text`` without its rendered blocks: what authors wrote themselves."""
    return re.sub(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)


def unregistered_blocks(texts: dict[str, str]) -> list[str]:
    """A marker pair on a page that ``BLOCKS`` does not render there would never be re-rendered."""
    return [
        f"{doc}: block {name!r} is not rendered there (add it to BLOCKS in docs/render.py)"
        for doc, text in texts.items()
        for name in re.findall(r"<!-- ([\w-]+):begin -->", text)
        if name not in BLOCKS.get(doc, {})
    ]


def homeless_figures(texts: dict[str, str]) -> list[str]:
    """A figure with one home (``HOMES``) rendered on another page, or a verifier figure written
    by hand outside docs/verify.md."""
    problems = [
        f"{doc}: renders {name!r}, whose figures live on {HOMES[make]} only: link there"
        for doc, blocks in BLOCKS.items()
        for name, make in blocks.items()
        if make in HOMES and HOMES[make] != doc
    ]
    figure = re.compile(r"\d+(?:\.\d+)?x\b|\d+(?:\.\d+)? ?(?:ms|MiB)\b")
    for doc, text in texts.items():
        if doc == "docs/verify.md":
            continue
        for line in _prose(text).splitlines():
            if re.search(r"verif|sampled check|full check", line, re.I) and figure.search(line):
                problems.append(f"{doc}: a verifier figure outside docs/verify.md: {line.strip()[:100]}")
    return problems


#: A statement of how many tests ran, or how long a test run took (a time on a line about tests).
_TEST_COUNT = re.compile(r"\b\d[\d,]* (?:passed|failed|skipped|collected|deselected|errors?)\b|\(\d+ tests\)")
_TEST_RUN = re.compile(r"make (?:test|demo)|test-fast|\btier\b|\bsuite\b|pytest|tests/")
_TEST_TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|min|minutes?|hours?)\b|\ban hour\b|\ba minute\b")


def test_figures_outside_testing(texts: dict[str, str]) -> list[str]:
    """Test counts and test-run times are stated in docs/testing.md only (the others link)."""
    problems = []
    for doc, text in texts.items():
        if doc == "docs/testing.md":
            continue
        lines = text.splitlines()
        for before, line in zip(["", *lines], lines, strict=False):
            # a time on a line about tests, or on the line after one (a sentence wraps)
            m = _TEST_COUNT.search(line) or (
                _TEST_RUN.search(before + " " + line) and _TEST_TIME.search(line)
            )
            if m:
                problems.append(f"{doc}: {m.group(0)!r}: test counts and times belong in docs/testing.md")
    return problems


#: A recipe name as the docs spell one (``tiny_debug_mxfp8``, ``llama3_8b_mxfp8_pretrain``), not a
#: module of that shape (``testing.emulated_mxfp8``, ``testing/te_mxfp8.py``).
_RECIPE = re.compile(r"(?<![\w./])[a-z0-9_]+_mxfp8(?:_pretrain|_launch|_finetune)?\b(?!\.py)")


def recipe_mentions(texts: dict[str, str]) -> list[str]:
    """Every recipe a page names is a file of ``recipes/``, and every recipe list lists them all."""
    files = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    problems = []
    for doc, text in texts.items():
        for name in sorted(set(_RECIPE.findall(text)) - set(files)):
            problems.append(f"{doc}: names recipe {name!r}, which recipes/ does not have")
        for m in _pattern("recipes").finditer(text):
            listed = re.findall(r"`([\w.-]+)`", m.group(2))
            if listed != files:
                problems.append(f"{doc}: its recipe list {listed} is not recipes/*.yaml {files}")
    return problems


def option_mentions(texts: dict[str, str]) -> list[str]:
    """Every plugin option a page names is a ``PluginOptions`` field, and a YAML block that lists
    most of them lists all (a partial list that looks whole is a contradiction)."""
    fields = list(_defaults())
    problems = []
    for doc, text in texts.items():
        named = re.findall(r"(?<![\w.])mxfp8_plugin\.([a-z_]+)\b", text)
        named += re.findall(r"\bPluginOptions\(([a-z_]+)=", text)
        problems += [
            f"{doc}: names option {n!r}, not a PluginOptions field" for n in sorted(set(named) - set(fields))
        ]
        for m in re.finditer(r"```yaml\n(?:[^`]*\n)?mxfp8_plugin:\n((?:[ \t]+[^\n]*\n)+)", text):
            keys = re.findall(r"^[ \t]+([a-z_]+):", m.group(1), re.M)
            problems += [
                f"{doc}: YAML sets option {k!r}, not a PluginOptions field" for k in keys if k not in fields
            ]
            if len(fields) / 2 < len(keys) < len(fields):
                missing = [f for f in fields if f not in keys]
                problems.append(
                    f"{doc}: a YAML block lists {len(keys)} of the {len(fields)} options without {missing}: "
                    "render the whole section (options block) or show only a few"
                )
    return problems


def exit_code_mentions(texts: dict[str, str]) -> list[str]:
    """Every exit status a page names is one of ``common/exit_codes.py``'s."""
    from mbridge_mxfp8_plugin.common.exit_codes import TABLE

    problems = []
    for doc, text in texts.items():
        for code in re.findall(r"\bexit(?:s|ing)?(?: (?:code|status))? (\d+)\b", text, re.I):
            if int(code) not in TABLE:
                problems.append(f"{doc}: names exit status {code}, which common/exit_codes.py does not have")
    return problems


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _releases(cell: str) -> list[str] | None:
    """``0.16.1``, ``0.17``, ``0.14 - 0.16``, ``0.4 / 0.5`` -> the releases; None: not a release."""
    cell = cell.replace("`", "").replace(".x", "").strip()
    m = re.fullmatch(r"(\d+\.\d+(?:\.\d+)?)(?:\s*-\s*(\d+\.\d+))?", cell)
    if m and m.group(2):
        (major, first, _), (_, last, _) = version(m.group(1)), version(m.group(2))
        return [f"{major}.{minor}" for minor in range(first, last + 1)]
    if m:
        return [m.group(1)]
    parts = [p.strip() for p in cell.split("/")]
    return parts if len(parts) > 1 and all(re.fullmatch(r"\d+\.\d+(?:\.\d+)?", p) for p in parts) else None


#: A pair named in one cell: ``megatron-core 0.14-0.16 + Bridge 0.3.x``.
_PAIR_CELL = re.compile(r"megatron-core ([\d.x -]+?) \+ (?:Megatron-)?Bridge ([\d.x /]+)", re.I)


def release_rows(texts: dict[str, str]) -> list[str]:
    """Every table row that states which defects a megatron-core / Bridge pair has agrees with
    :func:`pair_defects` (doctor's verdict from ``fixed_in``), on every page: a "training defects"
    column lists exactly the present ones of A, B1, B2, C, any other "defects" column exactly the
    present ones of all, an "E: ..." / "F: ..." column says present or fixed."""
    from mbridge_mxfp8_plugin.probes.defects import TRAINING_DEFECTS

    problems = []
    for doc, text in texts.items():
        for table in re.findall(r"(?:^\|[^\n]*\n)+", text, re.M):
            lines = table.splitlines()
            head = [h.lower() for h in _cells(lines[0])]
            core = next((i for i, h in enumerate(head) if "megatron-core" in h), None)
            bridge = next((i for i, h in enumerate(head) if "bridge" in h), None)
            columns = {i: h for i, h in enumerate(head) if "defects" in h or h[:2] in ("e:", "f:")}
            if not columns:
                continue
            for line in lines[2:]:
                cells = _cells(line)
                pair = _PAIR_CELL.search(cells[0])
                if core is not None and bridge is not None:
                    cores, bridges = _releases(cells[core]), _releases(cells[bridge])
                elif pair:
                    cores, bridges = _releases(pair.group(1)), _releases(pair.group(2))
                else:
                    continue
                if not cores or not bridges:
                    continue
                for i, head_i in columns.items():
                    cell = cells[i]
                    if cell in ("-", ""):
                        continue
                    if head_i[:2] in ("e:", "f:"):
                        ids: tuple[str, ...] = (head_i[0].upper(),)
                        listed = set(ids) if cell.split()[0] == "present" else set()
                    else:
                        ids = TRAINING_DEFECTS if "training" in head_i else tuple(DEFECTS)
                        listed = set(re.findall(r"\b(A|B1|B2|C|E|F)\b", cell))
                    for c in cores:
                        for b in bridges:
                            want = pair_defects(c, b)
                            if {d for d in ids if want[d]} != listed & set(ids) or listed - set(ids):
                                expected = ", ".join(d for d in ids if want[d]) or "none"
                                problems.append(
                                    f"{doc}: core {c} + Bridge {b}, {head_i!r}: {cell!r}; doctor's rule on "
                                    f"fixed_in says {expected}"
                                )
    return problems


def present_in_rows(texts: dict[str, str]) -> list[str]:
    """A defect table with a "present in" column lists every defect, and each "present in" cell
    (``core <= 0.16.1``, ``bridge <= 0.5.x``) ends one minor release before the one ``fixed_in``
    names for that defect (the last, where it names several)."""
    problems = []
    for doc, text in texts.items():
        for table in re.findall(r"(?:^\|[^\n]*\n)+", text, re.M):
            lines = table.splitlines()
            head = [h.lower() for h in _cells(lines[0])]
            if "id" not in head or "present in" not in head:
                continue
            at_id, at_present = head.index("id"), head.index("present in")
            listed = [_cells(line)[at_id].strip("*` ") for line in lines[2:]]
            if sorted(listed) != sorted(DEFECTS):
                problems.append(
                    f"{doc}: its defect table lists {listed}, probes/defects.py has {list(DEFECTS)}"
                )
            for line in lines[2:]:
                cells = _cells(line)
                defect = cells[at_id].strip("*` ")
                m = re.search(r"\b(core|bridge) <= (\d+\.\d+)", cells[at_present], re.I)
                if defect not in DEFECTS or not m:
                    continue
                package, releases = fixed_by(defect)
                said, fix = version(m.group(2)), max(releases, default=(0, 0, 0))
                if not releases or m.group(1).lower() != package or said[:2] != (fix[0], fix[1] - 1):
                    problems.append(
                        f"{doc}: {defect} present in {m.group(0)!r}, but fixed_in says "
                        f"{DEFECTS[defect].fixed_in!r}"
                    )
    return problems


#: Every contradiction check, each ``pages -> problems``.
CHECKS: tuple[Callable[[dict[str, str]], list[str]], ...] = (
    unregistered_blocks,
    homeless_figures,
    test_figures_outside_testing,
    recipe_mentions,
    option_mentions,
    exit_code_mentions,
    release_rows,
    present_in_rows,
)


def contradictions(texts: dict[str, str] | None = None) -> list[str]:
    """One line per statement that differs from its source or another page; empty when none."""
    texts = pages() if texts is None else texts
    return [line for check in CHECKS for line in check(texts)]


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for doc, blocks in BLOCKS.items():
            path = ROOT / doc
            new, _ = render(path.read_text(encoding="utf-8"), blocks)
            path.write_text(new, encoding="utf-8")
    problems = drift() + contradictions()
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
