"""Serve stand-in modules to a few named importers only, so Megatron-Bridge imports on CPU.

What it fakes: packages that cannot be installed on a CPU host (Transformer Engine) or that are
large and reached only through import statements whose names are never used by the code under
test (nvidia-resiliency-ext's in-process restart, modelopt's distillation/checkpoint plugins,
triton via ``mamba_ssm``-style kernels). ``import megatron.bridge.training.pretrain`` executes
those statements at module level, so without them ``pretrain()`` cannot even be imported.

Why importer-scoped and not a stub package on ``sys.path``: megatron-core probes for Transformer
Engine with ``try: import transformer_engine`` in many places and then takes TE code paths (or,
finding no ``__version__``, raises in ``get_te_version()``). The stub must therefore exist only
for the importers that cannot cope with its absence. :func:`importer_scoped_stubs` wraps
``builtins.__import__``: an ``import`` *statement* executed in the body of one of the named
modules gets the stub; every other importer falls through to the real import system (and gets
``ModuleNotFoundError`` where the package is absent). Nothing is put in ``sys.modules``, so
``importlib.util.find_spec`` and later imports elsewhere see the truth.

A stub object stands for any module, class or function at any depth (``te.pytorch.Linear``,
``modelopt.torch.opt.plugins.restore_sharded_modelopt_state``): attributes are made on demand,
it can be subclassed (Bridge's LoRA layers subclass TE's ``Linear``), and *calling* it raises,
naming what was called, so a test that reaches real TE or modelopt code fails loudly instead of
computing with a fake.

Inactive unless entered; leaving the context restores ``builtins.__import__``.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["BRIDGE_STUBS", "DECORATORS", "StubCalled", "importer_scoped_stubs", "stub_object"]


class StubCalled(RuntimeError):
    """Code under test called into a stubbed package: the test reached code it cannot run here."""


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = stub_object(f"{cls.__qualname__}.{name}")
        type.__setattr__(cls, name, child)
        return child

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.__qualname__ in DECORATORS and len(args) == 1 and callable(args[0]) and not kwargs:
            # Module-level `@triton.jit def kernel(...)`: the kernel becomes a stub that refuses to run.
            return stub_object(f"{cls.__qualname__}({getattr(args[0], '__qualname__', '?')})")
        # A subclass defined by the importer (class LoRALinear(te.Linear)) is only a stub if it
        # is one of ours; only stub objects themselves refuse to run.
        if cls.__dict__.get("_is_stub", False):
            raise StubCalled(
                f"{cls.__qualname__} is a test stub (harness.te_stub): the code "
                "under test called into a package that is not installed here"
            )
        return super().__call__(*args, **kwargs)


def stub_object(qualname: str) -> Any:
    """A stand-in for the module/class/function ``qualname``; attributes appear on first access."""
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (), {"_is_stub": True, "__module__": "stub"})
    cls.__qualname__ = qualname
    return cls


#: What Megatron-Bridge 0.3 ... 0.6 needs stubbed to import ``training.pretrain`` and run
#: ``pretrain()`` on CPU: top-level package -> modules whose own import statements may get it.
#: Transformer Engine: the three unguarded importers (``import megatron.bridge`` reaches them via
#: ``models.conversion.auto_bridge`` -> ... -> ``peft.canonical_lora``). nvidia-resiliency-ext:
#: ``training/pretrain.py`` imports ``CallWrapper`` unconditionally (used only with in-process
#: restart) and the registry's newest release asserts against core >= 0.18 when imported for real.
BRIDGE_STUBS: Mapping[str, frozenset[str]] = {
    "transformer_engine": frozenset(
        {
            "megatron.bridge.peft.lora_layers",
            "megatron.bridge.peft.lora",
            "megatron.bridge.models.gpt_full_te_layer_autocast_spec",
        }
    ),
    "nvidia_resiliency_ext": frozenset(
        {"megatron.bridge.training.pretrain", "megatron.bridge.training.inprocess_restart"}
    ),
    # Hugging Face datasets (pyarrow, pandas): used only by the SFT/packed-sequence datasets.
    # Each release adds HF-data modules (0.6: data.sources.hf, data.megatron_mimo, ...): the package prefix.
    "datasets": frozenset({"megatron.bridge.data."}),
    # GPU inference kernels, reached from `megatron.bridge.models.mamba` -> core's mamba_mixer.
    "triton": frozenset({"megatron.core.inference.contexts.attention_context.triton.tensor_ops"}),
    # Multimodal data loading (Bridge 0.6: training.config -> data.builders.energon -> data.energon.*):
    # energon pulls ~15 packages (s3fs, multi-storage-client, ...) and pretrain() on the mock GPT
    # dataset never touches it. A namespace subpackage, so the key is dotted (`from` imports only).
    "megatron.energon": frozenset({"megatron.bridge.data."}),
    "webdataset": frozenset({"megatron.bridge.data."}),
}


#: Stubbed callables used as decorators at import time: calling one with the decorated function
#: returns a stub in its place instead of raising.
DECORATORS = frozenset({"triton.jit"})


def _listed(importer: Any, importers: frozenset[str]) -> bool:
    if not isinstance(importer, str):
        return False
    return importer in importers or any(p.endswith(".") and importer.startswith(p) for p in importers)


@contextlib.contextmanager
def importer_scoped_stubs(stubs: Mapping[str, frozenset[str]] = BRIDGE_STUBS) -> Iterator[None]:
    """While entered, ``import <pkg>...`` in a module listed for ``pkg`` gets a stub object.

    ``stubs`` maps a package name to the importers (module ``__name__``; an entry ending in ``.``
    covers every module under that package) that get the stub. A dotted package name (a namespace
    subpackage such as ``megatron.energon``) is served to ``from ... import`` statements only: a bare
    ``import a.b`` binds ``a``, which must stay real. Re-entrant; restores the previous
    ``__import__`` on exit.
    """
    real_import = builtins.__import__
    roots: dict[str, Any] = {}

    def resolve(name: str) -> Any:
        head, *rest = name.split(".")
        obj = roots.setdefault(head, stub_object(head))
        for part in rest:
            obj = getattr(obj, part)
        return obj

    def scoped_import(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if level == 0 and globals is not None:
            importers = stubs.get(name.partition(".")[0])
            if importers is None and fromlist:
                importers = next(
                    (v for k, v in stubs.items() if "." in k and (name == k or name.startswith(k + "."))),
                    None,
                )
            if importers is not None and _listed(globals.get("__name__"), importers):
                # `import a.b as c` / `import a.b` bind the top package; `from a.b import x` the leaf.
                return resolve(name) if fromlist else resolve(name.partition(".")[0])
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        yield
    finally:
        builtins.__import__ = real_import
