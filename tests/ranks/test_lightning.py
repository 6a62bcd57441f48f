"""The Lightning adapter on a real ``lightning.pytorch.Trainer``, 2 gloo ranks, real megatron-core.

All loop orders (see ``harness.lightning_loop.ORDERS``) x {reference, plugin
off, plugin on} run in ONE 2-rank spawn (about 20 s); the tests assert on the recorded losses.
Without the plugin every order must visibly differ from the reference, so these tests can fail.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

from mbridge_mxfp8_plugin.errors import MXFP8UsageError  # noqa: E402
from mbridge_mxfp8_plugin.lightning import (  # noqa: E402
    MXFP8ParamSyncLightningCallback,
    find_megatron_optimizer,
    find_model_chunks,
)

TOL = 1e-4
ORDER_NAMES = ("nemo", "nemo_save_sanity", "staging_prehooks", "bridge")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL  # False for NaN, which counts as a difference


@pytest.fixture(scope="module")
def lightning_runs():
    from harness.lightning_loop import run_lightning_orders

    return run_lightning_orders(list(ORDER_NAMES), train_steps=9, val_every=3)


def _pair(runs, order: str, plugin: bool):
    return runs[(order, "reference")][0], runs[(order, "plugin" if plugin else "mxfp8")][0]


def test_lightning_runs_complete_and_ranks_agree(lightning_runs):
    for (order, mode), per_rank in lightning_runs.items():
        r0, r1 = per_rank
        assert len(r0.train_losses) == 9, (order, mode)
        assert [s for s, _, _ in r0.val_losses if s] == [3, 6, 9], (order, mode)
        assert str(r0.train_losses) == str(r1.train_losses), (order, mode)  # str: NaN-safe
        assert str(r0.val_losses) == str(r1.val_losses), (order, mode)
    sanity = lightning_runs[("nemo_save_sanity", "reference")][0].val_losses[0]
    assert sanity[:2] == (0, True)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_validation_losses_match_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    assert [(s, c) for s, c, _ in got.val_losses] == [(s, c) for s, c, _ in ref.val_losses]
    pairs = [(s, c, r, g) for (s, c, r), (_, _, g) in zip(ref.val_losses, got.val_losses, strict=True)]
    if plugin:
        assert all(_close(r, g) for *_, r, g in pairs), pairs
    else:
        # nemo*: pre-hooks gather the zeroed buffer (no staging); staging_prehooks: they gather
        # gradients; bridge: the forced sync leaves stale weights (B1) -- plus A everywhere.
        assert not any(_close(r, g) for *_, r, g in pairs), pairs


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_test_after_fit_matches_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    assert ref.test_loss is not None and got.test_loss is not None
    assert _close(ref.test_loss, got.test_loss) == plugin, (ref.test_loss, got.test_loss)


@pytest.mark.parametrize("plugin", [False, True], ids=["plugin_off", "plugin_on"])
@pytest.mark.parametrize("order", ORDER_NAMES)
def test_training_after_each_validation_matches_reference(lightning_runs, order, plugin):
    ref, got = _pair(lightning_runs, order, plugin)
    # The step right after each validation (and after the sanity check, before step 0).
    after = sorted({s for s, _, _ in ref.val_losses if s < len(ref.train_losses)})
    pairs = [(i, ref.train_losses[i], got.train_losses[i]) for i in after]
    if plugin:
        assert all(_close(r, g) for _, r, g in pairs), pairs
        assert all(_close(r, g) for r, g in zip(ref.train_losses, got.train_losses, strict=True))
    else:
        assert not any(_close(r, g) for _, r, g in pairs), pairs


def test_nemo_save_forces_sync_before_validation(lightning_runs):
    got = lightning_runs[("nemo_save_sanity", "plugin")][0]
    assert got.saves == [3, 6, 9]
    events = [e.split(":")[0] for e in got.plugin_events]
    # sanity check first, then save -> validation at each of steps 3, 6, 9. NeMo saves the last
    # step (max_steps) weights-only, which fires no on_save_checkpoint: the plugin prepares that
    # save at the step's on_train_batch_end.
    assert events[:2] == ["on_validation_start", "on_validation_end"]
    for k, save in enumerate(["on_save_checkpoint", "on_save_checkpoint", "on_train_batch_end"]):
        i = 2 + 3 * k
        assert events[i : i + 3] == [save, "on_validation_start", "on_validation_end"], events


# ---------------------------------------------------------------------- optional extra
def test_import_without_lightning_gives_install_hint():
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Block())
        import mbridge_mxfp8_plugin
        assert "lightning" not in sys.modules
        try:
            import mbridge_mxfp8_plugin.lightning
        except ImportError as exc:
            print("MSG=" + str(exc))
        else:
            raise SystemExit("imported without lightning")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.split("MSG=", 1)[1].strip()
    assert "\n" not in msg
    assert "pip install 'mbridge-mxfp8-plugin[lightning]'" in msg


# ---------------------------------------------------------------------- Lightning conventions
def _getter(trainer, pl_module):  # module level so it pickles
    return []


def test_callback_is_a_picklable_lightning_callback():
    from lightning.pytorch import Callback

    cb = MXFP8ParamSyncLightningCallback(model_getter=_getter, repair_alignment=False)
    assert isinstance(cb, Callback)
    assert cb.state_key.startswith("MXFP8ParamSyncLightningCallback")
    assert cb.state_dict() == {}
    cb.engine = SimpleNamespace(lock=lambda: None)  # runtime state must not travel
    cb.history.append(("x", None))
    clone = pickle.loads(pickle.dumps(cb))
    assert clone.engine is None and not clone.history
    assert clone.model_getter is _getter and clone.options.repair_alignment is False
    with pytest.raises(MXFP8UsageError, match="keeps no state"):
        cb.load_state_dict({"stale": 1})


def test_discovery_failure_names_what_was_found():
    import torch

    cb = MXFP8ParamSyncLightningCallback()
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2)), optimizers=[])
    with pytest.raises(MXFP8UsageError) as err:
        cb.on_fit_start(trainer, torch.nn.Sequential(torch.nn.ReLU()))
    msg = str(err.value)
    assert "Linear" in msg and "Sequential" in msg and "model_getter=" in msg


class _FakeDDP:
    """Duck-types megatron-core DDP for discovery (no buffers needed)."""

    def __init__(self, reuse: bool = True) -> None:
        self.ddp_config = SimpleNamespace(
            reuse_grad_buf_for_mxfp8_param_ag=reuse, use_distributed_optimizer=True, overlap_param_gather=True
        )
        self.buffers: list = []
        self.bucket_groups: list = []


def test_discovery_through_megatron_parallel_like_container_and_optimizer_wrappers():
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class Wrapper(torch.nn.Module):  # Float16Module-like: .module is the DDP chunk
        def __init__(self, inner):
            super().__init__()
            self.__dict__["module"] = inner

    chunks = [_FakeDDP(), _FakeDDP()]
    container = torch.nn.ModuleList([Wrapper(c) for c in chunks])  # MegatronParallel-like
    pl_module = torch.nn.Module()
    pl_module.add_module("megatron_parallel", container)
    found, fsdp = find_model_chunks([None, pl_module, container])
    assert found == chunks and fsdp == []

    dist_opt = DistributedOptimizer.__new__(DistributedOptimizer)
    chained = SimpleNamespace(chained_optimizers=[dist_opt])
    lightning_opt = SimpleNamespace(_optimizer=SimpleNamespace(mcore_optimizer=chained))
    assert find_megatron_optimizer([object(), lightning_opt]) is chained
    plain = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    assert find_megatron_optimizer([SimpleNamespace(optimizer=plain)]) is None

    cb = MXFP8ParamSyncLightningCallback(optimizer_getter=lambda t, m: object())
    with pytest.raises(MXFP8UsageError, match="optimizer_getter returned object"):
        cb._optimizer(SimpleNamespace(), None)


def test_inactive_run_is_a_noop_with_a_message(caplog):
    cb = MXFP8ParamSyncLightningCallback(model_getter=lambda t, m: [_FakeDDP(reuse=False)])
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        cb.on_fit_start(SimpleNamespace(optimizers=[]), None)
        cb.on_validation_start(SimpleNamespace(optimizers=[]), None)
        cb.on_train_batch_start(None, None, None, 0)
    assert cb.engine is None and not cb.history
    assert "inactive" in caplog.text and "reuse_grad_buf_for_mxfp8_param_ag" in caplog.text


def test_discovery_unwraps_attribute_forwarding_wrappers():
    """NeMo's ``MegatronParallel`` and its per-chunk wrappers forward unknown attribute lookups to
    the megatron-core DDP inside, so ``ddp_config`` and ``bucket_groups`` resolve on them while their
    ``buffers`` is ``nn.Module.buffers``. Discovery must return the DDP, not a wrapper."""
    import torch

    from mbridge_mxfp8_plugin.buckets import is_megatron_ddp

    class DDPLike(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ddp_config = _FakeDDP().ddp_config
            self.buffers = []  # instance list shadowing nn.Module.buffers, as megatron-core's DDP does
            self.bucket_groups = []

    class Forwarding(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name.startswith("_") or "module" not in self._modules:
                    raise
                return getattr(self._modules["module"], name)

    class MegatronParallelLike(torch.nn.ModuleList):
        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name.startswith("_") or "0" not in self._modules:
                    raise
                return getattr(self._modules["0"], name)

    ddps = [DDPLike(), DDPLike()]
    chunk_wrappers = [Forwarding(Forwarding(d)) for d in ddps]  # Float16Module-like around the DDP
    parallel = MegatronParallelLike(chunk_wrappers)
    assert hasattr(parallel, "ddp_config") and hasattr(chunk_wrappers[0], "bucket_groups")
    assert not is_megatron_ddp(parallel) and not any(is_megatron_ddp(w) for w in chunk_wrappers)
    assert all(is_megatron_ddp(d) for d in ddps)

    found, fsdp = find_model_chunks([parallel])
    assert found == ddps and fsdp == []
    cb = MXFP8ParamSyncLightningCallback()
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=parallel), optimizers=[])
    assert cb._chunks(trainer, None) == (ddps, None)
    # A model_getter that returns the wrappers (e.g. iterating MegatronParallel) is unwrapped too.
    cb = MXFP8ParamSyncLightningCallback(model_getter=lambda t, m: list(parallel))
    assert cb._chunks(trainer, None) == (ddps, None)
