"""One line for an import that failed: which package is missing or broken, and how to install it.

The launcher imports Megatron-Bridge, the recipe and the forward step only after its cheap
checks, and each of those imports can fail deep inside another package: Transformer Engine under
Bridge's peft modules, megatron-energon under Bridge's recipe package, a CUDA library under TE.
Python's traceback (26-53 lines there) names the cause on its last line and the fix nowhere.
Leaf module: standard library only.
"""

from __future__ import annotations

from types import TracebackType

__all__ = ["PACKAGES", "describe", "import_failure"]

#: import name (the longest dotted prefix wins) -> (what it is, how to install it)
PACKAGES: dict[str, tuple[str, str]] = {
    "megatron": ("megatron-core", "pip install megatron-core"),
    "megatron.bridge": (
        "Megatron-Bridge",
        "pip install megatron-bridge (or run in an NGC NeMo container, which ships it)",
    ),
    "megatron.energon": ("megatron-energon", "pip install megatron-energon"),
    "transformer_engine": (
        "Transformer Engine",
        "on a CUDA host, pip install --no-build-isolation 'transformer_engine[pytorch]' "
        "(or run in an NGC PyTorch container, which ships it)",
    ),
    "torch": ("PyTorch", "pip install torch"),
    "yaml": ("PyYAML", "pip install pyyaml"),
    "omegaconf": ("OmegaConf", "pip install 'omegaconf>=2.3,<2.4'"),
    "hydra": ("hydra-core", "pip install 'hydra-core>=1.3,<1.4'"),
    "nvidia_resiliency_ext": ("nvidia-resiliency-ext", "pip install nvidia-resiliency-ext"),
    "modelopt": ("nvidia-modelopt", "pip install nvidia-modelopt"),
    "transformers": ("Hugging Face transformers", "pip install transformers"),
    "diffusers": ("Hugging Face diffusers", "pip install diffusers"),
}


def describe(module: str) -> tuple[str, str]:
    """``(what it is, how to install it)`` for an import name; unknown names get a generic fix
    (a distribution's name need not be its import name)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        known = PACKAGES.get(".".join(parts[:i]))
        if known:
            return known
    return repr(parts[0]), f"install the distribution that provides the module {parts[0]!r}"


def _innermost_module(tb: TracebackType | None) -> str | None:
    """The module whose code raised: the last frame of the traceback outside the import system."""
    found = None
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__")
        if isinstance(name, str) and not name.startswith(("importlib", "_frozen_importlib")):
            found = name
        tb = tb.tb_next
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def import_failure(exc: BaseException, what: str, target: str) -> str:
    """One line for ``exc`` raised while importing ``target`` on behalf of ``what`` (a flag or
    a package name the user knows): the missing package and its install command, or the
    module that raised and its first line."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing:
        # `import megatron.bridge.x` failing on "megatron" means the target itself is absent.
        own = target == missing or target.startswith(missing + ".")
        package, fix = describe(target if own else missing)
        if own and package == repr(missing.split(".")[0]):  # not a package we know: the user's module
            return f"{what}: no module named {missing!r} (check the name and PYTHONPATH)"
        return f"{what}: {package} is not installed (no module named {missing!r}); fix: {fix}"
    culprit = _innermost_module(exc.__traceback__) or target
    package, fix = describe(culprit)
    return (
        f"{what}: importing {target} failed in {culprit} ({type(exc).__name__}: {_first_line(exc)}); "
        f"a broken or mismatched {package} install? fix: {fix}"
    )
