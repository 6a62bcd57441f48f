"""What a Megatron-Bridge recipe function sets, read from its source (``check --recipe NAME``).

A recipe YAML is merged onto the ``ConfigContainer`` a Python recipe builds, which ``check`` does
not run (that needs Bridge, torch and often a Hugging Face download). Its source still says a
lot: the model provider class when it constructs one by name, and the model knobs it assigns as
literals (``cfg.model.expert_model_parallel_size = 4``: MoE in the base recipe), and whether it
sets a ``comm_overlap`` section, which overwrites the overlap knobs of ddp and optimizer inside
``pretrain()`` (followed into the helpers it calls, two levels deep, as Bridge's recipes start from
``_pretrain_common()``). What the source does not say (a provider built by
``AutoBridge.from_hf_pretrained``) stays unknown, with why.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._source import block, megatron_subdir, module_file, user_module_file
from ._summary import summary

__all__ = ["SPLAT", "UNSTATED", "RecipeSource", "find_recipe", "recipe_facts"]

#: ``RecipeSource.comm_overlap`` when the source does not say whether the recipe sets one.
UNSTATED = "unstated"
#: A key of ``RecipeSource.comm_overlap``: the call also passes ``**kwargs`` (other knobs unknown).
SPLAT = "**"


@dataclass(frozen=True)
class RecipeSource:
    """A recipe function as its source tells it."""

    name: str
    path: str
    #: dotted path of the model provider class it builds; None when the source does not say
    provider: str | None
    #: why ``provider`` is None
    provider_why: str = ""
    #: ``cfg.model.<knob> = <literal>`` assignments
    model: dict[str, Any] = field(default_factory=dict)
    #: the ``CommOverlapConfig(...)`` it sets, as its literal keywords (with :data:`SPLAT` as a key
    #: when it also passes ``**kwargs``, whose knobs are then not known); None where it sets
    #: ``comm_overlap=None``; :data:`UNSTATED` where its source (and its helpers') does not say
    comm_overlap: dict[str, Any] | None | str = UNSTATED


def _recipes_dir() -> Path | None:
    return megatron_subdir("bridge/recipes", "__init__.py")


def _locate(name: str) -> tuple[Path, str] | None:
    """(file, function) of a recipe given as ``module:function`` (the launcher's form, a file path
    allowed as the module), a dotted path into Bridge, or a bare function name."""
    if ":" in name:
        module, _, func = name.rpartition(":")
        path = user_module_file(module) or module_file(module)
        return (path, func) if path is not None and func else None
    module, _, func = name.rpartition(".")
    if module:
        path = module_file(module)
        return (path, func) if path is not None else None
    root = _recipes_dir()
    if root is None:
        return None
    pattern = re.compile(rf"^def {re.escape(name)}\(", re.M)
    for path in sorted(root.rglob("*.py")):
        try:
            if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                return path, name
        except OSError:
            continue
    return None


def _provider(path: Path, call: ast.expr) -> tuple[str | None, str]:
    """The provider class a ``cfg.model = ...`` right-hand side constructs, as a dotted path."""
    if not isinstance(call, ast.Call):
        return None, "the recipe assigns cfg.model from an expression, not a constructor"
    func = ast.unparse(call.func)
    if "AutoBridge" in func or "from_hf_pretrained" in func or "to_megatron_provider" in func:
        return None, "the recipe builds its model provider from a Hugging Face config (AutoBridge)"
    head = func.split(".")[0]
    imported = (summary(path) or {}).get("imports", {}).get(head)
    if imported is None:
        return None, f"{func} is not a class imported by the recipe's module"
    base = imported[0] if imported[1] is None else f"{imported[0]}.{imported[1]}"
    return base + func[len(head) :], ""


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _SKIP


_SKIP = object()


@functools.lru_cache(maxsize=8)
def find_recipe(name: str) -> RecipeSource | None:
    """The recipe function ``name`` in the installed Megatron-Bridge; None when not found."""
    found = _locate(name)
    if found is None:
        return None
    path, func = found
    text = block(path.read_text(encoding="utf-8", errors="replace"), "def", func)
    if not text:
        return None  # the module exists, the function does not
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    provider: str | None = None
    why = _NO_MODEL
    model: dict[str, Any] = {}
    names: dict[str, ast.expr] = {}  # ``model_cfg = Provider(...)``; ``cfg.model = model_cfg``
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = ast.unparse(node.targets[0]).split(".")
        if len(target) == 1:
            names[target[0]] = node.value
        elif target[1:] == ["model"]:
            value = node.value
            if isinstance(value, ast.Name) and value.id in names:
                value = names[value.id]
            provider, why = _provider(path, value)
        elif len(target) == 3 and target[1] == "model":
            value = _literal(node.value)
            if value is not _SKIP:
                model[target[2]] = value
    if provider is None and why == _NO_MODEL:
        provider, why = _provider_in_helpers(path, tree, depth=2)
    return RecipeSource(func, str(path), provider, why, model, _comm_overlap(path, tree, depth=2))


_NO_MODEL = "the recipe does not assign cfg.model itself"


def _provider_in_helpers(path: Path, tree: ast.AST, depth: int) -> tuple[str | None, str]:
    """The provider a ``model=Provider(...)`` keyword constructs in the function (a recipe that
    builds its ``ConfigContainer(...)`` in one call), else in a helper it calls (see :func:`_helper`)."""
    names: dict[str, ast.expr] = {}  # ``model = Provider(...)`` ... ``ConfigContainer(model=model)``
    local: dict[str, str] = {}  # ``from pkg import Provider`` inside the function
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = node.value
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            local.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                value = kw.value
                if kw.arg != "model":
                    continue
                if isinstance(value, ast.Name) and value.id in names:
                    value = names[value.id]
                if isinstance(value, ast.Call) and ast.unparse(value.func) in local:
                    return local[ast.unparse(value.func)], ""
                if isinstance(value, ast.Call):
                    return _provider(path, value)
    for where, helper in _helpers(path, tree) if depth > 0 else ():
        provider, why = _provider_in_helpers(where, helper, depth - 1)
        if provider is not None or why != _NO_MODEL:
            return provider, why
    return None, _NO_MODEL


def _comm_overlap_value(node: ast.expr) -> dict[str, Any] | None | str:
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "CommOverlapConfig":
        kwargs = {kw.arg or SPLAT: _literal(kw.value) if kw.arg else True for kw in node.keywords}
        return {k: v for k, v in kwargs.items() if v is not _SKIP}
    return UNSTATED


def _comm_overlap(path: Path, tree: ast.AST, depth: int) -> dict[str, Any] | None | str:
    """What the function (``tree``) leaves ``comm_overlap`` as: its own last word
    (``cfg.comm_overlap = ...`` or ``comm_overlap=...`` in a call), else the last word of a helper
    it calls that is defined in its module or imported into it, ``depth`` levels deep."""
    said: list[tuple[int, dict[str, Any] | None | str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            if ast.unparse(node.targets[0]).split(".")[-1] == "comm_overlap":
                said.append((node.lineno, _comm_overlap_value(node.value)))
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "comm_overlap":
                    said.append((node.lineno, _comm_overlap_value(kw.value)))
    known = [value for _, value in sorted(said, key=lambda s: s[0]) if value != UNSTATED]
    if known:
        return known[-1]
    for where, helper in _helpers(path, tree) if depth > 0 else ():
        value = _comm_overlap(where, helper, depth - 1)
        if value != UNSTATED:
            return value
    return UNSTATED


def _helpers(path: Path, tree: ast.AST) -> Iterator[tuple[Path, ast.AST]]:
    """The functions ``tree`` calls by plain name whose source can be found, each once, in the
    order of the walk: where a recipe's section is set when the recipe does not set it itself."""
    calls = (node for node in ast.walk(tree) if isinstance(node, ast.Call))
    names = dict.fromkeys(call.func.id for call in calls if isinstance(call.func, ast.Name))
    for name in names:
        found = _helper(path, name)
        if found is not None:
            yield found


@functools.lru_cache(maxsize=64)
def _helper(path: Path, name: str) -> tuple[Path, ast.AST] | None:
    """The source of function ``name`` as the module at ``path`` sees it: defined there, or
    imported by ``from module import name`` from a file that can be found."""
    imported = (summary(path) or {}).get("imports", {}).get(name)
    where = path
    if imported is not None and imported[1] is not None:
        where = user_module_file(imported[0]) or module_file(imported[0])  # type: ignore[assignment]
        name = imported[1]
    if where is None:
        return None
    text = block(where.read_text(encoding="utf-8", errors="replace"), "def", name)
    if not text:
        return None
    try:
        return where, ast.parse(text)
    except SyntaxError:
        return None


def recipe_facts(container: Any, name: str) -> RecipeSource:
    """The same facts read off a built ``ConfigContainer`` (the launcher has one): its model
    provider's class and whether it holds a ``comm_overlap`` section, with that section's values."""
    model = getattr(container, "model", None)
    provider = f"{type(model).__module__}.{type(model).__qualname__}" if model is not None else None
    co = getattr(container, "comm_overlap", None)
    fields = getattr(co, "__dataclass_fields__", None)
    overlap = None if co is None else {k: getattr(co, k) for k in (fields or vars(co))}
    return RecipeSource(name, "(the built ConfigContainer)", provider, "", {}, overlap)
