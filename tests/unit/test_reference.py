"""The verifier's reference and reader, one process: each MXFP8 type is judged by its own rule,
and what the check cannot read or reproduce is refused with a reason, never misjudged (the
reader's own tests, and its refusals, are in test_read.py).

Three types: the kit's value-holding emulation and its TE-shaped one (TE's rule), and the OCP
spec's rule (tests/harness/ocp_mxfp8.py). The write into each param goes through the function the
installed megatron-core uses (``reference._core_write``), as a param sync's write-back does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness.ocp_mxfp8 import make_ocp_param, ocp_quantize

from mbridge_mxfp8_plugin.common.mxfp8_cast import mxfp8_quantize
from mbridge_mxfp8_plugin.testing.emulated_mxfp8 import EmulatedMXFP8Tensor
from mbridge_mxfp8_plugin.testing.te_mxfp8 import make_te_mxfp8_param
from mbridge_mxfp8_plugin.verify.read import Blocks, Reader, reader_for
from mbridge_mxfp8_plugin.verify.reference import _core_write, make_reference, self_check

pytestmark = pytest.mark.matrix  # the write function differs per megatron-core release


def _values_param(init: torch.Tensor) -> Any:
    return torch.nn.Parameter(mxfp8_quantize(init).to(torch.bfloat16).as_subclass(EmulatedMXFP8Tensor))


MAKERS = {"values": _values_param, "te": make_te_mxfp8_param, "ocp": make_ocp_param}
RULES = {"values": mxfp8_quantize, "te": mxfp8_quantize, "ocp": ocp_quantize}


def _source(rows: int = 64, cols: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    src = torch.randn(rows, cols, generator=g) * 0.05
    src[3, :32] = 0.0  # an all-zero block
    src[5, 0] = 1.9 * 2.0**-4  # amax mantissa 1.9 > 1.75: the rules pick different scales
    src[5, 1:32] = 0.01
    return src.to(torch.bfloat16)


def _written(kind: str, src: torch.Tensor) -> Any:
    """A param of ``kind`` after core's write of ``src`` into it."""
    param = MAKERS[kind](torch.zeros_like(src, dtype=torch.float32))
    write, _ = _core_write()
    with torch.no_grad():
        write(param.data, src)
    return param


def _dequantized(param: Any) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.to(param.dequantize(), torch.bfloat16)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_reference_is_the_types_own_write(kind: str) -> None:
    src = _source()
    param = _written(kind, src)
    # Every second block of the whole param, as (k, 32) rows of the source.
    blocks = Blocks(last=src.shape[-1], start=0, count=src.numel() // 64, step=2)
    rows = blocks.take(src.reshape(-1))
    want, small = make_reference(param)(rows)
    reader = reader_for(param)
    assert isinstance(reader, Reader), reader
    got = reader.values(blocks, torch.bfloat16)
    assert torch.equal(got, want)  # the param holds what the reference makes of its source
    assert torch.equal(want, RULES[kind](rows).to(torch.bfloat16))  # ... by the type's own rule
    assert torch.equal(got, blocks.take(_dequantized(param).reshape(-1)))  # reader == dequantize
    assert self_check(make_reference(param), small, want) is None
    assert (reader.scales is not None) == (kind == "te")  # TE-shaped: decoded from codes


def test_the_rules_differ_where_the_test_needs_them_to() -> None:
    """The control: a check that assumed TE's rule would call the OCP param wrong."""
    src = _source()
    ocp = _written("ocp", src)
    te_rule = mxfp8_quantize(src).to(torch.bfloat16)
    assert not torch.equal(_dequantized(ocp), te_rule)


def test_a_reader_that_misreads_the_type_is_refused() -> None:
    src = _source()
    param = _written("te", src)
    rows = Blocks(last=96, start=0, count=8, step=1).take(src.reshape(-1))
    reference = make_reference(param)
    want, small = reference(rows)
    small._rowwise_scale_inv[0, 0] += 1  # the codes no longer decode to what dequantize() gave
    reason = self_check(reference, small, want)
    assert reason and "do not decode to its own dequantize()" in reason
