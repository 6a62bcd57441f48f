"""Where the megatron-core model chunks are (mcore/chunks.py), behind the wrappers NeMo and Lightning
put around them: discovery returns the DDP chunks, never a wrapper that forwards their attributes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

from harness.fake_core import BucketlessChunk  # noqa: E402

from mbridge_mxfp8_plugin.adapters.lightning import (  # noqa: E402
    MXFP8ParamSyncLightningCallback,
    find_model_chunks,
)


def test_discovery_unwraps_attribute_forwarding_wrappers():
    """NeMo's ``MegatronParallel`` and its per-chunk wrappers forward unknown attribute lookups to
    the megatron-core DDP inside, so ``ddp_config`` and ``bucket_groups`` resolve on them while their
    ``buffers`` is ``nn.Module.buffers``. Discovery must return the DDP, not a wrapper."""
    import torch

    from mbridge_mxfp8_plugin.mcore.layout import is_megatron_ddp

    class DDPLike(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ddp_config = BucketlessChunk().ddp_config
            self.buffers = []  # instance list shadowing nn.Module.buffers, as megatron-core's DDP does
            self.bucket_groups = []

    def forwarding_to(child: str):
        """``__getattr__`` that looks a name up on ``child`` when the module itself lacks it."""

        def __getattr__(self, name: str):
            try:
                return torch.nn.Module.__getattr__(self, name)
            except AttributeError:
                if name.startswith("_") or child not in self._modules:
                    raise
                return getattr(self._modules[child], name)

        return __getattr__

    class Forwarding(torch.nn.Module):
        __getattr__ = forwarding_to("module")

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    class MegatronParallelLike(torch.nn.ModuleList):
        __getattr__ = forwarding_to("0")

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
