"""The CPU shim is reversible and only redirects what megatron-core needs."""

from __future__ import annotations

import torch

from mbridge_mxfp8_plugin.testing import cpu_shim


def test_shim_redirects_cuda_and_restores_torch():
    original_type = torch.Tensor.type
    original_sync = torch.cuda.synchronize
    with cpu_shim(enabled=True) as active:
        assert active
        t = torch.zeros(3, device="cuda", dtype=torch.bfloat16)
        assert t.device.type == "cpu"
        assert t.type() == "torch.cuda.BFloat16Tensor"
        assert t.cuda() is t
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()
        with cpu_shim(enabled=True):  # nested use shares the installation
            pass
        assert torch.cuda.current_device() == 0
    assert torch.Tensor.type is original_type
    assert torch.cuda.synchronize is original_sync
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_shim_is_off_when_disabled():
    with cpu_shim(enabled=False) as active:
        assert not active
        assert torch.zeros(1).type() == "torch.FloatTensor"
