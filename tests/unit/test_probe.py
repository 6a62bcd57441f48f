"""Probing a batch key once (verify/probe.py), on the kit's TE-shaped type in one process.

For codes, the probe writes a key's first blocks through a small instance of the param's own type:
the reading is trusted only if the codes decode to that instance's own ``dequantize``; the batch
size follows the memory budget (whole 32-row tiles, at least one); the fused kernel stands in for
the type's write only where it writes the type's bytes. A type the probe cannot write or read is
refused with the reason and the probe returns (a rank must still join the all-reduce).
"""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.testing import te_mxfp8
from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
from mbridge_mxfp8_plugin.verify import fused
from mbridge_mxfp8_plugin.verify.batches import Item
from mbridge_mxfp8_plugin.verify.probe import Probed
from mbridge_mxfp8_plugin.verify.read import BLOCK, Blocks, Reader, reader_for

KEY = ("te",)


def _codes_item(rows: int = 256, cols: int = 128) -> tuple[torch.Tensor, Item]:
    torch.manual_seed(0)
    main = torch.randn(rows, cols) * 0.02
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(main.to(torch.bfloat16))
    reader = reader_for(param)
    assert isinstance(reader, Reader)
    blocks = Blocks(last=cols, start=0, count=rows * cols // BLOCK, step=1)
    return param, Item(0, reader, main.reshape(-1), 0, blocks, mxfp8_codes=True)


@pytest.fixture
def no_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")


def test_values_are_not_probed_and_batches_follow_the_budget() -> None:
    flat = torch.zeros(64 * BLOCK, dtype=torch.bfloat16)
    item = Item(0, Reader(flat), flat.float(), 0, Blocks(last=64, start=0, count=64, step=1))
    probed = Probed()
    small, large = (
        probed.probe(KEY, flat, item, torch.bfloat16, 1),
        Probed().probe(KEY, flat, item, None, 1 << 30),
    )
    assert small == BLOCK and large > small  # at least one tile; more memory, larger batches
    assert probed.capacity[KEY] == small
    assert not probed.references and not probed.trusted and not probed.refused


def test_codes_are_trusted_after_the_probe_write(no_fused) -> None:
    param, item = _codes_item()
    probed = Probed()
    cap = probed.probe(KEY, param, item, torch.bfloat16, 64 << 20)
    assert KEY in probed.trusted and KEY not in probed.refused and KEY in probed.references
    assert probed.capacity[KEY] == cap and cap % BLOCK == 0
    assert KEY not in probed.fused


def test_the_budget_bounds_the_batch_of_codes(no_fused) -> None:
    param, item = _codes_item()
    caps = [Probed().probe(KEY, param, item, torch.bfloat16, budget) for budget in (1, 1 << 20, 1 << 24)]
    assert caps[0] == BLOCK and caps[0] < caps[1] < caps[2]
    assert all(c % BLOCK == 0 for c in caps)
    # a batch's main rows and the reference's codes alone take 3 bytes per element
    assert caps[1] * BLOCK * 3 <= 1 << 20 and caps[2] * BLOCK * 3 <= 1 << 24


needs_fused = pytest.mark.skipif(
    not fused.available(torch.device("cpu")), reason="the fused kernel cannot run here (TRITON_INTERPRET)"
)


@needs_fused
def test_the_fused_kernel_stands_in_where_it_writes_the_types_bytes(monkeypatch) -> None:
    param, item = _codes_item()
    probed = Probed()
    cap = probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert KEY in probed.trusted and KEY in probed.fused
    # Its batches are not bounded by the write's memory (it allocates nothing); a flagged one is
    # judged again by the type's own write a budget-sized part at a time.
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    by_budget = Probed().probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert probed.written[KEY] == by_budget and cap > by_budget


@needs_fused
def test_a_type_of_another_rule_is_trusted_but_keeps_its_own_write(monkeypatch) -> None:
    """Same values as TE's rule, other bytes (half the codes, twice the scale): the reading is
    right, but the kernel, which writes TE's bytes, must not judge this type."""
    cast = te_mxfp8.mxfp8_cast

    def other_rule(src: torch.Tensor):
        codes, scales = cast(src)
        return (codes.float() / 2).to(codes.dtype), scales + 1

    monkeypatch.setattr(te_mxfp8, "mxfp8_cast", other_rule)
    param, item = _codes_item()
    probed = Probed()
    probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert KEY in probed.trusted and KEY not in probed.refused
    assert KEY not in probed.fused and KEY not in probed.written


def test_a_type_whose_codes_do_not_decode_to_its_dequantize_is_refused(monkeypatch) -> None:
    """A layout read wrongly makes the params ``unchecked``, never ``WRONG``."""
    decode = te_mxfp8.mxfp8_decode
    monkeypatch.setattr(te_mxfp8, "mxfp8_decode", lambda *a, **k: decode(*a, **k) * 2)
    param, item = _codes_item()
    probed = Probed()
    cap = probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert "do not decode to its own dequantize()" in probed.refused[KEY]
    assert KEY not in probed.trusted and KEY not in probed.fused and probed.capacity[KEY] == cap


def test_a_type_it_cannot_write_is_refused_with_the_reason() -> None:
    param, item = _codes_item()

    class Broken(TEShapedMXFP8Quantizer):
        def copy(self) -> Broken:
            return self

        def make_empty(self, *a, **k):
            raise RuntimeError("no small instance of this type")

    param._quantizer = Broken(rowwise=True, columnwise=False)
    probed = Probed()
    probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)  # does not raise
    reason = probed.refused[KEY]
    assert "TEShapedMXFP8Tensor" in reason and "no small instance of this type" in reason
    assert KEY not in probed.trusted
