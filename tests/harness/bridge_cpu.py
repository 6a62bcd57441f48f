"""Run Megatron-Bridge's own ``pretrain()`` on a CPU-only host (and import it on any host).

Bridge's setup path assumes CUDA in a few places that do not change what training computes. On
top of :func:`~mbridge_mxfp8_plugin.testing.cpu_shim.cpu_shim` (device, streams, tensor type
names) and :func:`~harness.te_stub.importer_scoped_stubs` (Transformer
Engine and friends, served only to the modules that import them unguarded), :func:`bridge_on_cpu`
fakes:

* ``torch.cuda.is_available()`` -> True only while ``initialize_megatron`` runs: it asserts CUDA
  before doing anything (there is an ``allow_no_cuda`` argument, but ``setup()`` never passes it);
* the CUDA RNG state (``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and
  megatron-core's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) -> a private CPU generator:
  megatron-core's RNG tracker seeds and forks it; with dropout off nothing draws from it, so
  which generator it is does not change a single value;
* ``compile_helpers`` -> no-op, on every host: it runs ``make`` in megatron-core's datasets
  directory, but the wheel ships the built extension and no Makefile;
* ``set_jit_fusion_options`` -> no-op: a CUDA-only warm-up of fused bias/GeLU kernels;
* a fresh torch ``Adam``'s per-param ``step`` while megatron-core builds the *template* of a
  distributed-optimizer checkpoint load (only where megatron-core found neither Apex nor TE, so it
  falls back to torch's Adam, i.e. on every host without TE): ``DistributedOptimizer.state_dict()``
  asserts one common ``step`` over the inner optimizer's per-param state, which torch creates
  only at the first ``step()``. A resume calls it on a fresh optimizer, so Bridge's ``load_checkpoint``
  fails before reading a byte. During that one call each param gets ``step = 0`` (the template's
  placeholder) and the state is emptied again, so the load allocates it as it would anyway;
* the same torch-Adam fallback's ``step`` on load: ``load_state_dict`` puts the checkpoint's step
  into every param's state as *one shared tensor* (torch's Adam then adds 1 per param per step:
  +16 per iteration for 16 params), and the parameter-state load afterwards copies the template's
  placeholder step over it (the torch_dist files hold no per-param step). Here the parameter-state
  load leaves ``step`` alone and each param gets its own copy: the state a TE/Apex fused Adam (step
  per param group) would resume with. Without this a resumed run's Adam bias correction is wrong
  from its first step, plugin or not (measured: loss off by 0.1 two steps after the resume).

Everything is reversible and inactive until entered; on a CUDA host only the stubs and the
``compile_helpers`` no-op apply.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mbridge_mxfp8_plugin.testing.cpu_shim import cpu_shim

from .te_stub import BRIDGE_STUBS, importer_scoped_stubs

__all__ = ["NO_CPU_FUSIONS", "bridge_on_cpu", "cpu_cuda_rng", "reuse_mode_knobs", "torch_adam_checkpoints"]

#: Model-config knobs both real frameworks' CPU runs turn off: each names a fused CUDA/TE kernel
#: (or, persist_layer_norm, Apex's) that has no CPU implementation.
# Constructor keywords, alike in shape to others on purpose (duplicates lists them): data.
NO_CPU_FUSIONS: dict[str, bool] = dict(
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    cross_entropy_loss_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
)


def reuse_mode_knobs(mx: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DDP, optimizer) knobs of the mode the plugin serves, as both real frameworks' runs set them:
    distributed optimizer, overlapped grad reduce and param gather, Adam on bf16 params; with ``mx``
    MXFP8 params gathered through the grad buffer (``reuse_grad_buf_for_mxfp8_param_ag``), without
    it the same job in bf16 (the reference)."""
    both: dict[str, Any] = {"use_distributed_optimizer": True, "overlap_param_gather": True}
    both["reuse_grad_buf_for_mxfp8_param_ag"] = mx
    ddp = {**both, "overlap_grad_reduce": True, "grad_reduce_in_fp32": True, "fp8_param_gather": mx}
    optimizer = {**both, "optimizer": "adam", "weight_decay": 0.0, "bf16": True}
    optimizer.update(params_dtype=torch.bfloat16, fp8_recipe="mxfp8" if mx else None)
    return ddp, optimizer


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuCudaRng:
    """The "CUDA" generator on a CPU host: a private CPU generator, so the global one is untouched."""

    def __init__(self) -> None:
        self.gen = torch.Generator()

    def get_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.gen.set_state(state.clone() if hasattr(state, "clone") else state)

    def seed(self, seed: int, *args: Any, **kwargs: Any) -> None:
        self.gen.manual_seed(int(seed))


def _claim_cuda_during(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # type: ignore[assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.is_available = real  # type: ignore[assignment]

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def patched(targets: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``(obj, name, value)`` attributes for the block, then restore each object's own ``__dict__``
    entry (deleting it where there was none): restoring ``getattr``'s value instead would leave an
    inherited attribute shadowed on the subclass after the block. The NeMo harness uses it too."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in targets]
    for obj, name, value in targets:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _state_dict_of_fresh_torch_adam(original: Callable[..., Any]) -> Callable[..., Any]:
    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.optimizer
        if len(inner.state) != 0:
            return original(self, *args, **kwargs)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p]["step"] = torch.tensor(0.0)
        try:
            return original(self, *args, **kwargs)
        finally:
            inner.state.clear()

    state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    return state_dict


def _keep_loaded_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        # Layouts that store no per-param step (fully reshardable) omit it here; the copy loop
        # still visits every state key, so it gets the loaded step too.
        group, order = self.model_param_group_index_map[model_param]
        current = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order], {})
        if "step" in current:
            tensors = {**tensors, "step": current["step"]}
        return original(self, model_param, tensors)

    set_states.__wrapped__ = original  # type: ignore[attr-defined]
    return set_states


def _unshared_steps(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return out

    load_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    return load_state_dict


@contextlib.contextmanager
def bridge_on_cpu(cpu: bool | None = None) -> Iterator[bool]:
    """Enter before importing ``megatron.bridge``; yields whether the CPU patches are active.

    ``cpu=None`` activates the CPU patches only where CUDA is absent. Import Bridge's modules
    inside the context: the importer-scoped stubs must be in place when they are first executed.
    """
    with importer_scoped_stubs(BRIDGE_STUBS), cpu_shim(cpu) as on_cpu:
        targets: list[tuple[Any, str, Any]] = []
        datasets_utils = _module("megatron.core.datasets.utils")
        initialize = _module("megatron.bridge.training.initialize")
        setup = _module("megatron.bridge.training.setup")
        for mod in (datasets_utils, initialize):
            if mod is not None and hasattr(mod, "compile_helpers"):
                targets.append((mod, "compile_helpers", _noop))
        if on_cpu:
            for mod in (initialize, setup):
                if mod is None:
                    continue
                if hasattr(mod, "initialize_megatron"):
                    targets.append((mod, "initialize_megatron", _claim_cuda_during(mod.initialize_megatron)))
                if hasattr(mod, "set_jit_fusion_options"):
                    targets.append((mod, "set_jit_fusion_options", _noop))
        with (
            patched(targets),
            torch_adam_checkpoints(),
            cpu_cuda_rng() if on_cpu else contextlib.nullcontext(),
        ):
            yield on_cpu


@contextlib.contextmanager
def torch_adam_checkpoints() -> Iterator[None]:
    """Distributed-optimizer checkpoints with the torch ``Adam`` megatron-core falls back to without
    Apex or TE: the fresh-state template and the per-param ``step`` on load (module docstring).
    Inactive where megatron-core found Apex or TE. Reversible."""
    targets: list[tuple[Any, str, Any]] = []
    distrib_optimizer = _module("megatron.core.optimizer.distrib_optimizer")
    if distrib_optimizer is not None and not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        cls = distrib_optimizer.DistributedOptimizer
        targets.append((cls, "state_dict", _state_dict_of_fresh_torch_adam(cls.state_dict)))
        targets.append((cls, "load_state_dict", _unshared_steps(cls.load_state_dict)))
        if hasattr(cls, "_set_main_param_and_optimizer_states"):
            setter = cls._set_main_param_and_optimizer_states
            targets.append((cls, "_set_main_param_and_optimizer_states", _keep_loaded_step(setter)))
    with patched(targets):
        yield


@contextlib.contextmanager
def cpu_cuda_rng() -> Iterator[None]:
    """The CUDA RNG state functions of torch and megatron-core on a private CPU generator.

    Every stack built on megatron-core (Bridge, NeMo 2) seeds and forks the "CUDA" generator through
    these while setting up model parallelism, which fails on a host without CUDA. Reversible.
    """
    rng = _CpuCudaRng()
    targets: list[tuple[Any, str, Any]] = [
        (torch.cuda, "get_rng_state", rng.get_state),
        (torch.cuda, "set_rng_state", rng.set_state),
        (torch.cuda, "manual_seed", rng.seed),
        (torch.cuda, "manual_seed_all", rng.seed),
    ]
    core_random = _module("megatron.core.tensor_parallel.random")
    if core_random is not None:
        targets += [
            (core_random, "_get_cuda_rng_state", rng.get_state),
            (core_random, "_set_cuda_rng_state", rng.set_state),
        ]
    with patched(targets):
        yield
