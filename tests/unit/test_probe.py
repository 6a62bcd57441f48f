"""Probing a batch key once (verify/probe.py), on the kit's TE-shaped type in one process.

For codes, the probe writes a key's first blocks through a small instance of the param's own type:
the reading is trusted only if the codes decode to that instance's own ``dequantize``; the batch
size follows the memory budget (whole 32-row tiles, at least one); the fused kernel stands in for
the type's write only where it writes the type's bytes. A type the probe cannot write or read is
refused with the reason and the probe returns (a rank must still join the all-reduce).

The gate (issue 32.5): a codes-holding type of another scale rule (the OCP spec's, as in
tests/harness/ocp_mxfp8.py, here in TE's shape) must keep its own write even where its first
blocks happen to agree with the kernel, or a param holding TE's bytes, wrong for that type, would
pass with the kernel named as its judge.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mbridge_mxfp8_plugin.common.mxfp8_cast import mxfp8_quantize
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


@needs_fused
def test_one_write_of_the_type_serves_the_self_check_and_the_gate(monkeypatch) -> None:
    """The probe's first blocks and the gate's crafted blocks go through the type's write once
    (each write was about a millisecond of small launches on an H100's host, at a plan's first
    call), and the kernel's gate still sees every crafted block: a rule that parts from TE's on
    them alone keeps its own write (below)."""
    writes = []
    real = te_mxfp8.TEShapedMXFP8Quantizer.update_quantized

    def counted(self: Any, src: torch.Tensor, dst: Any, **kwargs: Any) -> Any:
        writes.append(src.numel() // BLOCK)
        return real(self, src, dst, **kwargs)

    param, item = _codes_item()
    monkeypatch.setattr(te_mxfp8.TEShapedMXFP8Quantizer, "update_quantized", counted)
    probed = Probed()
    probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert KEY in probed.trusted and KEY in probed.fused
    assert len(writes) == 1 and writes[0] > item.blocks.count, writes  # the first blocks and the crafted


@needs_fused
def test_a_rule_that_parts_from_tes_only_on_the_crafted_blocks_keeps_its_own_write(monkeypatch) -> None:
    """TE's bytes on the probe's first blocks (moderate values), another scale on blocks whose
    amax is past 2**60 (only crafted blocks have one): the gate must still shut."""
    cast = te_mxfp8.mxfp8_cast

    def parts_at_extremes(src: torch.Tensor):
        codes, scales = cast(src)
        huge = src.reshape(-1, BLOCK).abs().amax(dim=1) > 2.0**60
        return codes, torch.where(huge.reshape(scales.shape), scales + 1, scales)

    monkeypatch.setattr(te_mxfp8, "mxfp8_cast", parts_at_extremes)
    param, item = _codes_item()
    probed = Probed()
    probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert KEY in probed.trusted and KEY not in probed.fused


@needs_fused
def test_a_type_whose_write_refuses_the_crafted_blocks_is_still_trusted(monkeypatch) -> None:
    """Its own first blocks decide whether its reading is trusted; the kernel does not stand in."""
    cast = te_mxfp8.mxfp8_cast

    def refuses_extremes(src: torch.Tensor):
        if src.abs().amax() > 2.0**60:
            raise ValueError("out of range")
        return cast(src)

    monkeypatch.setattr(te_mxfp8, "mxfp8_cast", refuses_extremes)
    param, item = _codes_item()
    probed = Probed()
    probed.probe(KEY, param, item, torch.bfloat16, 1 << 20)
    assert KEY in probed.trusted and KEY not in probed.refused and KEY not in probed.fused


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


# ------------------------------------------------------------- the gate: another rule, TE's bytes
class _OCPRuleQuantizer(TEShapedMXFP8Quantizer):
    """TE's shape (codes, E8M0 bytes, a quantizer), the OCP MX spec's scale rule: the rule of
    tests/harness/ocp_mxfp8.py (``floor(log2(amax)) - 8``, saturating), written as codes."""

    def copy(self) -> _OCPRuleQuantizer:
        return _OCPRuleQuantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag=None):  # type: ignore[no-untyped-def]
        assert dst._rowwise_data is not None and dst._rowwise_scale_inv is not None
        codes, scales = _ocp_cast(src.detach().reshape(-1, dst.shape[-1]))
        dst._rowwise_data.copy_(codes.reshape(dst._rowwise_data.shape))
        dst._rowwise_scale_inv[: scales.shape[0], : scales.shape[1]].copy_(scales)
        return dst


def _ocp_cast(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes ``(r, last)`` and E8M0 bytes ``(r, last / 32)`` by the OCP spec's rule."""
    blocks = rows.float().reshape(rows.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    _, e = torch.frexp(amax)
    shared = torch.where(amax > 0, e - 1 - 8, torch.full_like(e, -127)).clamp(-127, 127)
    codes = torch.ldexp(blocks, -shared).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = (shared + 127).to(torch.uint8).reshape(rows.shape[0], -1)
    return codes.view(torch.uint8).reshape(rows.shape), scales


def _ocp_param(values: torch.Tensor) -> torch.Tensor:
    return _OCPRuleQuantizer(rowwise=True, columnwise=False).quantize(values.to(torch.bfloat16))


def _benign(rows: int = 32, last: int = 256) -> torch.Tensor:
    """bf16 values whose every block has amax ``1.5 * 2**k``: amax mantissas at most 1.75, where
    the OCP rule and TE's pick the same scale and so write the same bytes."""
    gen = torch.Generator().manual_seed(11)
    blocks = (torch.rand(rows, last // BLOCK, BLOCK, generator=gen) * 2 - 1) * 1.5
    blocks[..., 0] = 1.5
    blocks *= torch.exp2(torch.randint(-6, 7, (rows, last // BLOCK, 1), generator=gen).float())
    return blocks.reshape(rows, last).to(torch.bfloat16)


def _with_te_bytes(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``param`` holding what TE's rule writes for ``values``: for a type of another rule, wrong."""
    codes, scales = te_mxfp8.mxfp8_cast(values)
    param._rowwise_data.copy_(codes.view(torch.uint8).reshape(param._rowwise_data.shape))
    param._rowwise_scale_inv[: scales.shape[0], : scales.shape[1]].copy_(scales)
    return param


def _kernel_differs(param: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes of ``param`` the fused kernel finds differing from TE's cast of ``values``."""
    reader = reader_for(param)
    assert isinstance(reader, Reader)
    rows, last = values.shape
    flags = torch.zeros(1, dtype=torch.int32)
    blocks = Blocks(last=last, start=0, count=rows * last // BLOCK, step=1)
    phase = torch.zeros((), dtype=torch.int64)
    fused.compare(values.float().reshape(-1), 0, reader, blocks, True, flags, 0, phase)
    return int(flags[0])


def _shard_check(params: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Probed]:
    from mbridge_mxfp8_plugin.verify.batches import Owned
    from mbridge_mxfp8_plugin.verify.report import WeightReport
    from mbridge_mxfp8_plugin.verify.shard import ShardCheck

    report, probed = WeightReport(event="test"), Probed()
    check = ShardCheck(report, atol=0.0, stride=1, offset=0, budget_bytes=64 << 20, probed=probed)
    for name, (param, main) in params.items():
        reader = reader_for(param)
        assert isinstance(reader, Reader)
        check.add(name, param, reader, Owned(main.reshape(-1), 0, main.numel(), torch.bfloat16), mxfp8=True)
    check.finish(max_names=5)
    return report, probed


def test_the_codes_type_of_another_rule_writes_the_harness_rule() -> None:
    """The test type's rule is tests/harness/ocp_mxfp8.py's, and parts from TE's on the data."""
    from harness.ocp_mxfp8 import ocp_quantize

    values = (torch.randn(32, 256, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    assert torch.equal(_ocp_param(values).dequantize(), ocp_quantize(values).to(torch.bfloat16))
    assert not torch.equal(_ocp_param(values).dequantize(), mxfp8_quantize(values).to(torch.bfloat16))
    benign = _benign()
    te_bytes = _with_te_bytes(_ocp_param(benign), benign)
    assert torch.equal(_ocp_param(benign)._rowwise_data, te_bytes._rowwise_data)
    assert torch.equal(_ocp_param(benign)._rowwise_scale_inv, te_bytes._rowwise_scale_inv)


@needs_fused
@pytest.mark.parametrize("first", ["benign", "wrong"])
def test_a_param_of_another_rule_holding_te_bytes_is_found_not_passed_by_the_kernel(first: str) -> None:
    """Issue 32.5, the gate: the fused kernel answers "equal" for TE's bytes, so for a type of
    another rule it must not stand in for the type's write. ``wrong`` holds what TE's rule makes
    of its main shard (for this type, other values); ``benign`` blocks are written alike by both
    rules. Where ``benign`` opens the batch key, its probe blocks agree with the kernel and only
    the crafted blocks keep the gate shut. The report names ``wrong`` and no fused judge."""
    values = (torch.randn(32, 256, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    wrong = _with_te_bytes(_ocp_param(values), values)
    assert _kernel_differs(wrong, values) == 0  # the kernel finds it equal to TE's cast
    assert not torch.equal(wrong.dequantize(), _ocp_param(values).dequantize())  # wrong by its rule
    params = {"wrong": (wrong, values.float())}
    if first == "benign":
        benign = _benign()
        params = {"benign": (_ocp_param(benign), benign.float()), **params}
    report, probed = _shard_check(params)
    assert not probed.fused and not probed.refused, (probed.fused, probed.refused)
    assert not report.ok and [m.name for m in report.shard_mismatches] == ["wrong"], report.message()
    assert report.params_checked == len(params)
    paths = report.reference_paths
    assert paths and not any("fused" in p for p in paths), paths


@needs_fused
def test_the_same_layout_of_te_rule_is_judged_by_the_kernel() -> None:
    """The control: with TE's own rule the same params are current, and the kernel judges them
    (the gate is all that keeps it from the type above)."""
    values = (torch.randn(32, 256, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    benign = _benign()
    te = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False)
    report, probed = _shard_check(
        {"benign": (te.quantize(benign), benign.float()), "wrong": (te.quantize(values), values.float())}
    )
    assert probed.fused and report.ok, report.message()
    assert any("fused" in p for p in report.reference_paths), report.reference_paths
