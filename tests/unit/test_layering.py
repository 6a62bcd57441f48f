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
    "common": 0,  # logging, argument / YAML types, the MXFP8 cast rule, missing-dependency messages
    "options": 1,
    # what the installed releases are and do
    "mcore": 1,  # megatron-core's objects as the plugin reads them (the one reader of its layout)
    "probes": 2,
    # three columns side by side, never importing each other: the config judge, the engine, the
    # weight verifier (the verifier reads megatron-core through mcore, never through the engine)
    "config": 3,
    "engine": 3,
    "verify": 3,
    # where the columns meet: one session per adapter, events -> engine calls
    "adapters": 4,
    # the public test kit: the plugin never imports it, only the demo command
    "testing": 5,
    # entry points
    "commands": 6,
    # the public import paths users write, each a re-export of the room that holds the code
    "lightning": 7,
    "recipes": 7,
    "launch": 7,
    "__main__": 7,
}

#: Within one layer, imports are allowed only inside these packages (their own internal order is
#: checked for cycles below).
SAME_LAYER_OK = ("probes", "config", "testing")

#: The package root holds only its public face: these modules and the rooms above.
ROOT_MODULES = {"__init__", "__main__", "errors", "options", "lightning", "recipes", "launch"}


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
    assert any(d.startswith("config") for d in GRAPH["commands.check"])
    # demo imports the kit inside its functions only
    assert any(d.startswith("testing") for d in GRAPH["commands.demo"])


def test_the_package_root_is_its_public_face() -> None:
    modules = {p.stem for p in PKG.glob("*.py")}
    assert modules == ROOT_MODULES, (
        f"modules at the package root beyond its public face: {modules - ROOT_MODULES}"
    )
    rooms = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(LAYERS) - ROOT_MODULES, rooms ^ (set(LAYERS) - ROOT_MODULES)


#: megatron-core's layout attributes: the buffers (dense and expert), buckets and their params,
#: bucket groups, and the distributed optimizer's main-shard maps. Read by mcore/layout.py only.
LAYOUT_ATTRIBUTES = (
    "buffers",
    "expert_parallel_buffers",
    "buckets",
    "params_list",
    "param_index_map",
    "bucket_groups",
    "expert_parallel_bucket_groups",
    "shard_fp32_from_float16_groups",
    "model_float16_groups",
    "_get_model_param_range_map",
    "model_param_gbuf_map",
)


def _attribute_reads(path: Path) -> set[str]:
    """Layout attributes a module reads: ``x.attr`` and ``getattr(x, "attr", ...)``; not ``self.attr``
    (the plugin's own objects: a report's ``buckets`` count, the engine's ``bucket_groups()``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in LAYOUT_ATTRIBUTES
            and isinstance(node.ctx, ast.Load)
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in LAYOUT_ATTRIBUTES
        ):
            found.add(str(node.args[1].value))
    return found


def test_megatron_core_layout_is_read_in_one_module() -> None:
    readers = {_module_name(p): sorted(attrs) for p in PKG.rglob("*.py") if (attrs := _attribute_reads(p))}
    assert set(readers) == {"mcore.layout"}, readers


def test_the_layout_grep_sees_both_forms_of_a_read() -> None:
    """Without this the test above could pass by reading nothing."""
    assert _attribute_reads(PKG / "mcore" / "layout.py") >= {
        "buffers",
        "expert_parallel_buffers",
        "model_param_gbuf_map",
    }


#: Size floors (issue 31): a package module a reader takes in at once, a function on one screen;
#: a test or harness module under 600 lines.
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TEST_MODULE_LINES = 450, 80, 600
TESTS = PKG.parent / "tests"


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_modules_and_functions_stay_small() -> None:
    """No package module over 450 lines, no package function over 80, no test or harness module
    over 600 (a split by job, not a wrap: see docs/layout.md)."""
    big = [
        f"{p.relative_to(PKG)} ({n} lines)"
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, f"package modules over {MAX_MODULE_LINES} lines: {big}"
    long = [f for p in sorted(PKG.rglob("*.py")) for f in _long_functions(p)]
    assert not long, f"package functions over {MAX_FUNCTION_LINES} lines: {long}"
    big_tests = [
        f"{p.relative_to(TESTS)} ({n} lines)"
        for p in sorted(TESTS.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_TEST_MODULE_LINES
    ]
    assert not big_tests, f"test/harness modules over {MAX_TEST_MODULE_LINES} lines: {big_tests}"
