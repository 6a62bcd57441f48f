"""The Lightning callback in one process: the optional extra, Lightning's conventions (picklable,
stateless) and finding megatron-core's chunks and optimizer through the wrappers Lightning and NeMo
put around them (attribute-forwarding wrappers: tests/unit/test_chunks.py). The callback on a real
Trainer and real ranks: tests/ranks/test_lightning.py."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

from harness.fake_core import BucketlessChunk  # noqa: E402

from mbridge_mxfp8_plugin.adapters.lightning import (  # noqa: E402
    MXFP8ParamSyncLightningCallback,
    find_megatron_optimizer,
    find_model_chunks,
)
from mbridge_mxfp8_plugin.errors import MXFP8UsageError  # noqa: E402


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
            import mbridge_mxfp8_plugin.adapters.lightning
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


@pytest.mark.parametrize("strict", [True, False])
def test_no_megatron_chunk_is_one_line_and_nothing_else_as_in_bridge(caplog, strict):
    """A Lightning model without megatron-core DDP chunks: one rank-0 WARNING naming what was
    seen and ``model_getter``, then every hook a no-op, whatever ``strict`` (it used to raise
    at ``Trainer.fit`` even with strict=False)."""
    import torch

    cb = MXFP8ParamSyncLightningCallback(strict=strict)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2)), optimizers=[])
    module = torch.nn.Sequential(torch.nn.ReLU())
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        cb.on_fit_start(trainer, module)
        cb.on_train_start(trainer, module)
        cb.on_train_batch_start(trainer, module, None, 0)
        cb.on_validation_start(trainer, module)
        cb.on_validation_end(trainer, module)
        cb.on_train_batch_start(trainer, module, None, 1)
    lines = [r for r in caplog.records if r.name.startswith("mbridge_mxfp8_plugin")]
    assert len(lines) == 1 and lines[0].levelno >= logging.WARNING, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "Linear" in msg and "Sequential" in msg and "model_getter=" in msg
    assert cb.engine is None and not cb.history


def test_a_model_getter_that_finds_no_chunk_is_an_error():
    import torch

    cb = MXFP8ParamSyncLightningCallback(model_getter=lambda t, m: torch.nn.Linear(2, 2))
    with pytest.raises(MXFP8UsageError) as err:
        cb.on_fit_start(SimpleNamespace(optimizers=[]), None)
    assert "Linear" in str(err.value) and "model_getter's result" in str(err.value)


def test_discovery_through_megatron_parallel_like_container_and_optimizer_wrappers():
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class Wrapper(torch.nn.Module):  # Float16Module-like: .module is the DDP chunk
        def __init__(self, inner):
            super().__init__()
            self.__dict__["module"] = inner

    chunks = [BucketlessChunk(), BucketlessChunk()]
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
    cb = MXFP8ParamSyncLightningCallback(model_getter=lambda t, m: [BucketlessChunk(reuse=False)])
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        cb.on_fit_start(SimpleNamespace(optimizers=[]), None)
        cb.on_validation_start(SimpleNamespace(optimizers=[]), None)
        cb.on_train_batch_start(None, None, None, 0)
    assert cb.engine is None and not cb.history
    assert "inactive" in caplog.text and "reuse_grad_buf_for_mxfp8_param_ag" in caplog.text
