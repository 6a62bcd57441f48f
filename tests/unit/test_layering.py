"""The package's import graph: no cycle, and no module importing one that stands above it.

Read from the source with ``ast``, so imports inside functions (the lazy ones that keep ``check``
fast) count as much as top-level ones, and ``importlib.import_module`` with a literal name too.
The layers are the design: leaves, probes, the config column and the engine (side by side, never
importing each other), the adapters that join them, the entry points. A new module must be placed
in :data:`LAYERS`, which makes the author decide where it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "mbridge_mxfp8_plugin"
ROOT = "mbridge_mxfp8_plugin"

#: module (dotted, relative to the package; a package means every module under it) -> layer.
#: A module may import modules of a lower layer, or of its own layer when listed in SAME_LAYER_OK.
LAYERS: dict[str, int] = {
    # leaves: facts and helpers that import nothing of the package (or only other leaves)
    "errors": 0,
    "_log": 0,
    "_yamltypes": 0,
    "_argtypes": 0,
    "defects": 0,
    "recipe_files": 0,
    "_missing": 0,
    "mxfp8_cast": 0,
    "options": 1,
    # what the installed releases do
    "probes": 2,
    "buckets": 2,
    # the config column (read -> view -> effective -> rules -> report, orchestrated by validate)
    "config": 3,
    # the runtime column: copy planning, the engine, the weight verifier
    "plan": 3,
    "chunks": 3,  # finding the DDP chunks behind a caller's wrappers
    "sync": 4,
    "verify": 4,  # the weight check: reads only, beside the engine, never importing it
    # defect F: re-derive the params after a checkpoint load (drives the engine)
    "resume": 5,
    # where the two columns meet: what every adapter shares, incl. the train-start config check
    "_adapter": 6,
    "ensure": 6,  # ensure_weights_current: a repair on demand, through the engine
    # adapters: events -> engine calls
    "bridge": 7,
    "lightning": 7,
    "api": 7,
    # entry points
    "recipes": 8,
    "_launch_report": 8,
    "launch": 9,
    "check": 9,
    "doctor": 9,
    "demo": 9,
    "cli": 10,
    # the public test kit stands apart: the plugin never imports it (only demo, an entry point)
    "testing": 8,
}

#: Within one layer, imports are allowed only inside these packages (their own internal order is
#: checked for cycles below).
SAME_LAYER_OK = ("probes", "config", "testing")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    base = current.split(".") if current else []
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    target = ".".join([*base, module] if module else base)
    return target


def _lazy_names() -> dict[str, str]:
    """``__init__``'s lazy map (public name -> submodule), to resolve ``from . import name``."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "_WHERE" for t in targets):
                return {k: v for k, v in ast.literal_eval(node.value).items()}  # type: ignore[arg-type]
    return {}


def _edges() -> dict[str, set[str]]:
    lazy = _lazy_names()
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _resolve(name, is_pkg, node.level, node.module)
                elif node.module and node.module.startswith(ROOT):
                    base = node.module[len(ROOT) + 1 :]
                else:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    if sub in known:
                        targets.append(sub)
                    elif not base and alias.name in lazy:
                        targets.append(lazy[alias.name])  # from . import name -> its submodule
                    elif base:
                        targets.append(base)
            elif isinstance(node, ast.Import):
                targets += [a.name[len(ROOT) + 1 :] for a in node.names if a.name.startswith(ROOT + ".")]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith(ROOT)
            ):
                targets.append(node.args[0].value[len(ROOT) + 1 :])
            deps.update(t for t in targets if t and t != name)
        graph[name] = {d for d in deps if d in known or any(k.startswith(d + ".") for k in known)}
    return graph


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[0]
    if top not in LAYERS:
        raise AssertionError(f"module {module!r} has no place in LAYERS (tests/unit/test_layering.py)")
    return top, LAYERS[top]


GRAPH = _edges()


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        if module:  # the package root (lazy public API) stands above everything
            _layer(module)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m))
def test_no_module_imports_one_above_it(module: str) -> None:
    top, layer = _layer(module)
    for dep in GRAPH[module]:
        if not dep:
            continue
        dtop, dlayer = _layer(dep)
        if dtop == top:
            continue  # inside one package: the cycle test below judges it
        assert dlayer < layer or (dlayer == layer and top in SAME_LAYER_OK and dtop == top), (
            f"{module} (layer {layer}) imports {dep} (layer {dlayer})"
        )


def test_no_import_cycle() -> None:
    seen: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in sorted(GRAPH.get(node, ())):
            if dep not in GRAPH:
                continue
            if seen.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep] if dep in stack else [node, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in seen:
                visit(dep, [*stack, dep])
        seen[node] = 2

    for start in sorted(GRAPH):
        if start and start not in seen:
            visit(start, [start])


def test_the_checker_sees_function_level_imports() -> None:
    """The graph must include lazy imports, or the tests above could not fail on them."""
    assert "config.validate" in GRAPH["check"] or any(d.startswith("config") for d in GRAPH["check"])
    # demo imports the kit inside its functions only
    assert any(d.startswith("testing") for d in GRAPH["demo"])
