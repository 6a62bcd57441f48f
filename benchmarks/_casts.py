"""One-pass stand-ins for Transformer Engine's fused cast kernel, for the test kit's two MXFP8
types: each swaps the type's cast for one pass per write while the context is open, so that
engines (and the verifier's reference) are timed without the emulation's ~ten fp32 passes."""

from __future__ import annotations

import contextlib
from typing import Any


def nothing() -> Any:
    return contextlib.nullcontext()


def plain_quantizer() -> Any:
    """Swap the emulated quantizer for one in-place cast: what TE's fused kernel costs in launches
    and memory (no temporaries), so engine overheads are measured without the emulation's. It does
    not round onto the MXFP8 grid: timings only, never values."""
    import torch

    from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor

    @contextlib.contextmanager
    def ctx() -> Any:
        orig = EmulatedMXFP8Tensor.quantize_

        def direct(self: Any, values: torch.Tensor) -> None:
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.copy_(self, values.reshape(self.shape))

        EmulatedMXFP8Tensor.quantize_ = direct  # type: ignore[method-assign]
        try:
            yield
        finally:
            EmulatedMXFP8Tensor.quantize_ = orig  # type: ignore[method-assign]

    return ctx()


def one_pass_te() -> Any:
    """Swap the TE-shaped quantizer's cast for one pass per direction: codes = the source cast to
    E4M3 directly, every scale byte 127 (unit scale). Stands in for TE's fused kernel (one read
    of the source, one write of codes and scales) so the transition and the verifier's reference
    cost what they would with TE; not TE's values, but the param and the reference agree."""
    import torch

    from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer

    @contextlib.contextmanager
    def ctx() -> Any:
        orig = TEShapedMXFP8Quantizer.update_quantized

        def one_pass(self: Any, src: torch.Tensor, dst: Any, *, noop_flag: Any = None) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                values = torch.Tensor.reshape(src, dst.shape)
                for used, data, scales in (
                    (self.rowwise_usage, dst._rowwise_data, dst._rowwise_scale_inv),
                    (self.columnwise_usage, dst._columnwise_data, dst._columnwise_scale_inv),
                ):
                    if used:
                        data.view(torch.float8_e4m3fn).copy_(values.clamp(-448, 448))
                        scales.fill_(127)
            dst._fp8_dtype = self.dtype
            return dst

        TEShapedMXFP8Quantizer.update_quantized = one_pass  # type: ignore[method-assign]
        try:
            yield
        finally:
            TEShapedMXFP8Quantizer.update_quantized = orig  # type: ignore[method-assign]

    return ctx()
