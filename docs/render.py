"""Render the numbers and lists the docs repeat from their one source, between marker comments.

Each block of a doc that repeats something kept elsewhere (the plugin's options, the defect and
hazard tables, the loop API's calls, the GPU benchmark's figures) sits between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` and is written here from its source:
``PluginOptions``' field docstrings (``options.py``), ``defects.py``, ``adapters/loop.py``'s docstring,
and the committed benchmark results (:data:`RESULTS`). Only the text between markers is touched,
so the prose around a block stays its author's.

    python docs/render.py           # exit 1 and name each block that differs from its source
    python docs/render.py --write   # rewrite those blocks

``tests/unit/test_docs.py`` runs the check, so a doc and its source cannot disagree in CI.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbridge_mxfp8_plugin.probes.defects import DEFECTS, HAZARDS  # noqa: E402
from mbridge_mxfp8_plugin.options import PluginOptions, option_docs  # noqa: E402

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


def verify_ratio() -> str:
    """The sampled verifier's cost at 4B over the eval transition, across the passes."""
    return _span([r["ratio_verify_vs_eval"] for r in _rows("4B")])


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


def verify_table() -> str:
    """The weight verifier after the eval transition at 4B, sampled and full, pass 1 / pass 2."""
    rows = _rows("4B")

    def col(key: str) -> list[Any]:
        return _col(rows, key)

    sample = rows[0]["verify_sample"]
    return (
        f"| 4B, 2 x H200, DP=2 | one-pass quantizer | emulated quantizer |\n|---|---:|---:|\n"
        f"| eval transition | {_ms(col('plugin_prestaged_plainquant_s'))} "
        f"| {_ms(col('plugin_prestaged_s'))} |\n"
        f"| verify, sampled ({sample:g} of the blocks) | {_ms(col('verify_plainquant_s'))} "
        f"| {_ms(col('verify_s'))} |\n"
        f"| verify, full | {_ms(col('verify_full_plainquant_s'))} | {_ms(col('verify_full_s'))} |\n"
        f"| **sampled / transition** | **{_ratios(col('ratio_verify_vs_eval'))}** "
        f"| {_ratios(col('ratio_verify_vs_eval_emulated'))} |\n"
        f"| peak temporaries, sampled | {_gb(col('verify_plainquant_peak_extra_bytes'))} "
        f"| {_gb(col('verify_peak_extra_bytes'))} |\n"
    )


def _mib(values: list[int]) -> str:
    return " / ".join(f"{v / 2**20:.0f}" for v in values) + " MiB"


def _gb(values: list[int]) -> str:
    return " / ".join(f"{v / 1e9:.2f}" for v in values) + " GB"


def targets_table() -> str:
    """Every target the benchmark checks, with each pass's value and verdict."""
    passes = _results()["passes"]
    names = list(dict.fromkeys(c["check"] for p in passes for c in p["checks"]))
    out = ["| target | " + " | ".join(f"pass {i + 1}" for i in range(len(passes))) + " |",
           "|---|" + "---|" * len(passes)]
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


#: ``mxfp8-plugin check``'s cost (``benchmarks/check_speed.py``).
CHECK_SPEED = ROOT / "benchmarks" / "results" / "check_speed.json"


def check_speed() -> str:
    """check's median wall time per cold process, with what moves it, from the last run."""
    r = json.loads(CHECK_SPEED.read_text())
    parts = [
        f"**{r['check']['median_s']:.2f} s** for a recipe",
        f"{r['check_with_overrides']['median_s']:.2f} s with `key=value` overrides",
    ]
    if "check_no_summary_cache" in r:
        parts.append(f"{r['check_no_summary_cache']['median_s']:.2f} s without the source-summary cache")
    load = "-".join(f"{v:g}" for v in r["loadavg_1m_before_after"])
    return (
        ", ".join(parts) + f" (median of {len(r['check']['runs_s'])} cold processes; `import omegaconf` "
        f"alone {r['import_omegaconf']['median_s']:.2f} s; {r['cpus']} CPUs at load average {load}; "
        f"{r['date']})"
    )


#: The weight verifier's own run (``benchmarks/eval_sync.py verify``, the TE-shaped type), when
#: one has been committed; until then the verifier figures come from :data:`RESULTS`.
VERIFY_RESULTS = ROOT / "benchmarks" / "results" / "verify_te" / "verify_te.json"


def verify_te_table() -> str:
    """The verifier on the TE-shaped type, per size and megatron-core release: params written by
    TE's rule (compared by the fused kernel) and by another rule (the type's own write)."""
    result = json.loads(VERIFY_RESULTS.read_text())
    out = [
        "**TE's rule** (the emulated TE-rule cast wrote the weights; the check takes the fused kernel):",
        "",
        "| model | core | eval transition (one-pass / emulated) | sampled check | full check "
        "| sampled / eval | full / eval | first calls / eval (sampled / full) | graphs "
        "| full / its floor | extra peak (sampled / full) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        if not r.get("fused"):
            continue
        graphs = "replayed" if r.get("full_emulated_graphs") else "eager"
        out.append(
            f"| {r['size']} | {r['core']} | {_ms([r['eval_onepass_s'], r['eval_emulated_s']])} "
            f"| {_ms([r['sampled_emulated_s']])} | {_ms([r['full_emulated_s']])} "
            f"| **{r['ratio_sampled_fused_vs_eval_onepass']:.2f}** "
            f"| **{r['ratio_full_fused_vs_eval_onepass']:.2f}** "
            f"| {r['ratio_sampled_first_round_fused_vs_eval_onepass']:.2f} / "
            f"{r['ratio_full_first_fused_vs_eval_onepass']:.2f} | {graphs} "
            f"| {r['ratio_full_fused_vs_floor']:.2f} "
            f"| {_mib([r['sampled_emulated_peak_extra_bytes'], r['full_emulated_peak_extra_bytes']])} |"
        )
    out += [
        "",
        "**Another rule** (the one-pass stand-in wrote the weights; the kernel is refused at the probe "
        "and the check goes through the type's own write):",
        "",
        "| model | core | sampled check | full check | sampled / eval | full / eval "
        "| first calls / eval (sampled / full) | graphs | extra peak (sampled / full) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        graphs = "replayed" if r.get("full_onepass_graphs") else "eager"
        out.append(
            f"| {r['size']} | {r['core']} | {_ms([r['sampled_onepass_s']])} | {_ms([r['full_onepass_s']])} "
            f"| {r['ratio_sampled_vs_eval_onepass']:.2f} | {r['ratio_full_vs_eval_onepass']:.2f} "
            f"| {r['ratio_sampled_first_round_vs_eval_onepass']:.2f} / "
            f"{r['ratio_full_first_vs_eval_onepass']:.2f} | {graphs} "
            f"| {_mib([r['sampled_onepass_peak_extra_bytes'], r['full_onepass_peak_extra_bytes']])} |"
        )
    out += ["", "| target | result |", "|---|---|"]
    out += [f"| {name} | {'pass' if ok else '**MISS**'} |" for name, ok in result["checks"]]
    return "\n".join(out) + "\n"


def verify_te_ratio() -> str:
    """The 4B ratios of the newest verifier run, as a sentence fragment."""
    rows = [r for r in json.loads(VERIFY_RESULTS.read_text())["rows"] if r["size"] == "4B"]

    def span(key: str) -> str:
        lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
        return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"

    return (
        f"sampled {span('ratio_sampled_fused_vs_eval_onepass')}x, full "
        f"{span('ratio_full_fused_vs_eval_onepass')}x an eval transition with the one-pass cast at 4B "
        f"(params written by TE's rule; another rule: sampled {span('ratio_sampled_vs_eval_onepass')}x, "
        f"full {span('ratio_full_vs_eval_onepass')}x)"
    )


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
        "options": options_yaml,
        "api-calls": api_calls,
        "verify-te-ratio": verify_te_ratio,
        "recipes": recipe_names,
    },
    "docs/launch.md": {"options": options_list},
    "docs/megatron-lm.md": {"api-calls": api_calls, "api-example": api_example_block},
    "docs/performance.md": {
        "eval-table": eval_table,
        "targets": targets_table,
        "verify-table": verify_table,
        "verify-ratio": verify_ratio,
        "verify-te-table": verify_te_table,
        "verify-te-ratio": verify_te_ratio,
        "emulated-ratio": emulated_ratio,
        "hooks-us": hooks_us,
        "host-refresh": host_refresh,
        "plugin-full": plugin_full,
    },
    "docs/layout.md": {"layers": layers_table},
    "docs/check.md": {"check-speed": check_speed, "recipes": recipe_names},
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


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for doc, blocks in BLOCKS.items():
            path = ROOT / doc
            new, _ = render(path.read_text(encoding="utf-8"), blocks)
            path.write_text(new, encoding="utf-8")
    problems = drift()
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
