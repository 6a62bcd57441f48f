"""The docs say what their sources say, and their code runs as written.

Numbers and lists that live elsewhere (options, defect and hazard tables, the defects of each
release pair, the loop API's calls, check's options, the exit codes, the GPU benchmark's figures) are
rendered into the docs by ``docs/render.py``; these tests fail when a rendered block no longer
matches its source (fix: ``python docs/render.py --write``). What a page states in its own words is
checked against its source by ``tests/unit/test_docs_agree.py``. Every Python
snippet must import what it uses: its ``mbridge_mxfp8_plugin`` imports are executed, its upstream
imports are looked up in the installed sources without importing them (Bridge needs Transformer
Engine to import). Paths a doc names must exist, and commands must not name files that only a
checkout has.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import pydoc
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _renderer():
    spec = importlib.util.spec_from_file_location("docs_render", ROOT / "docs" / "render.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _renderer()


def test_every_rendered_block_matches_its_source() -> None:
    problems = render.drift()
    assert not problems, "\n".join(problems) + "\nfix: python docs/render.py --write"


@pytest.mark.parametrize(("doc", "name"), [(d, n) for d, blocks in render.BLOCKS.items() for n in blocks])
def test_a_stale_block_is_caught(doc: str, name: str) -> None:
    """The drift check can fail: a block whose text differs from its source is rewritten."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    begin = f"<!-- {name}:begin -->"
    at = text.index(begin) + len(begin)
    at += text[at] == "\n"
    stale = text[:at] + "stale " + text[at:]
    fixed, missing = render.render(stale, {name: render.BLOCKS[doc][name]})
    assert not missing and fixed == text


def test_help_shows_every_option_docstring() -> None:
    """``help(PluginOptions)`` carries each field's docstring (docs/check.md says so), read here
    from the class source by ``inspect``, not by the code under test."""
    import dataclasses
    import inspect

    from mbridge_mxfp8_plugin.options import PluginOptions

    shown = " ".join(pydoc.render_doc(PluginOptions, renderer=pydoc.plaintext).split())
    source = inspect.getsource(PluginOptions)
    for field in dataclasses.fields(PluginOptions):
        m = re.search(rf"\n    {field.name}: [^\n]*\n    \"\"\"(.*?)\"\"\"", source, re.S)
        assert m, f"PluginOptions.{field.name} has no docstring"
        assert " ".join(m.group(1).split()) in shown, field.name


def test_the_loop_api_snippets_make_apis_calls() -> None:
    """The README's Megatron-LM block makes the calls api.py's docstring lists, in that order."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"## Megatron-LM's own loop.*?```python\n(.*?)```", readme, re.S)
    assert m
    assert render.api_calls_in(m.group(1)) == render.api_calls_in(render.api_example())


# ----------------------------------------------------------------------------- snippets
#: The user's own objects a snippet may use without defining them.
PLACEHOLDERS = {"cfg", "config", "model", "optimizer", "data", "iteration", "ckpt", "ckpt_dir", "log_dir"}


def _snippets() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1)))
    return out


SNIPPETS = _snippets()


def _module_source(dotted: str) -> Path | None:
    """The installed file of ``dotted``, found without importing it or its parents."""
    parts = dotted.split(".")
    for entry in sys.path:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _defines(path: Path, name: str) -> bool:
    """``name`` is bound at the top of the module (def, class, assignment or import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name).split(".")[0] == name for a in node.names):
                return True
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return (path.parent / name).is_dir() or (path.parent / f"{name}.py").is_file()  # a submodule


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_defines_or_imports_every_name(where: str, code: str) -> None:
    tree = ast.parse(code)
    bound = set(dir(builtins)) | PLACEHOLDERS
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used - bound, f"{where} uses names it neither imports nor defines: {sorted(used - bound)}"


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_imports_resolve(where: str, code: str) -> None:
    unchecked = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        module = node.module if isinstance(node, ast.ImportFrom) else None
        for alias in node.names:
            target = module or alias.name
            if target.split(".")[0] in ("mbridge_mxfp8_plugin", *sys.stdlib_module_names):
                imported = importlib.import_module(target)
                assert module is None or hasattr(imported, alias.name), f"{where}: {target}.{alias.name}"
                continue
            path = _module_source(target)
            if path is None:
                unchecked.append(target)
                continue
            assert module is None or _defines(path, alias.name), f"{where}: {target} has no {alias.name}"
    if unchecked:
        pytest.skip(f"{where}: not installed here, not checked: {', '.join(sorted(set(unchecked)))}")


# ----------------------------------------------------------------------------- paths
def _code(text: str) -> str:
    return "\n".join(m.group(1) for m in re.finditer(r"```\w*\n(.*?)```", text, re.S))


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_commands_name_recipes_a_wheel_install_has(doc: Path) -> None:
    """``recipes/x.yaml`` exists only in a checkout; from a wheel the shipped name works."""
    assert not re.findall(r"\brecipes/[\w.-]+\.yaml", _code(doc.read_text(encoding="utf-8")))


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_repo_paths_named_in_docs_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    top = "tests|benchmarks|mbridge_mxfp8_plugin|requirements|recipes|docs"
    named = set(re.findall(rf"`((?:{top})/[\w./-]+)`", text))
    missing = [p for p in sorted(named) if "*" not in p and not (ROOT / p.rstrip("/")).exists()]
    assert not missing, missing


def test_requirements_comments_name_modules_and_files_that_exist() -> None:
    for req in sorted((ROOT / "requirements").glob("*.txt")):
        comments = " ".join(line for line in req.read_text().splitlines() if "#" in line)
        for dotted in re.findall(r"\bmbridge_mxfp8_plugin(?:\.\w+)+", comments):
            assert importlib.util.find_spec(dotted) is not None, f"{req.name} names {dotted}"
        for path in re.findall(r"\b((?:tests|requirements|\.ci)/[\w./-]+\.\w+)", comments):
            assert (ROOT / path).exists(), f"{req.name} names {path}"


def test_wheel_names_carry_the_package_version() -> None:
    from mbridge_mxfp8_plugin import __version__

    for doc in DOCS:
        for version in re.findall(r"mbridge_mxfp8_plugin-([\w.]+)-py3-none-any\.whl", doc.read_text()):
            assert version == __version__, f"{doc.name} names wheel {version}, the package is {__version__}"


def test_layout_names_every_layer_module() -> None:
    """docs/layout.md's picture and rules name every module the layering test places, so a new
    module cannot land without its place in the described layout."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    prose = re.sub(r"<!-- layers:begin -->.*?<!-- layers:end -->", "", text, flags=re.S)
    layers, _ = render.layering_tables((ROOT / "tests" / "unit" / "test_layering.py").read_text())
    missing = [m for m in layers if not re.search(rf"(?<![\w.]){re.escape(m)}(\.py|/)", prose)]
    assert not missing, f"docs/layout.md does not place {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_package_paths_named_in_docs_exist(doc: Path) -> None:
    """`config/x.py`, `probes/x.py`, `verify/x.py`, `testing/x.py`: the package's files by their
    folder (upstream's own paths start elsewhere: training/, distributed/, megatron/)."""
    text = doc.read_text(encoding="utf-8")
    named = set(
        re.findall(
            r"`((?:config|probes|verify|testing|mcore|engine|adapters|commands|common)/[\w/]+\.py)`", text
        )
    )
    missing = sorted(p for p in named if not (ROOT / "mbridge_mxfp8_plugin" / p).exists())
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_tests_named_in_docs_exist(doc: Path) -> None:
    """`tests/x.py::test_name` (a trailing `*` or `[*]` meaning any): the test is in that file."""
    missing = []
    for path, name in re.findall(r"`(tests/[\w./]+\.py)::(\w+\*?)", doc.read_text(encoding="utf-8")):
        source = (ROOT / path).read_text(encoding="utf-8") if (ROOT / path).is_file() else ""
        pattern = rf"def {name[:-1]}\w*\(" if name.endswith("*") else rf"def {name}\("
        if not re.search(pattern, source):
            missing.append(f"{path}::{name}")
    assert not missing, missing
