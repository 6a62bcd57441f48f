"""The shard check (verify/shard.py), driven directly on tensors in one process with a main shard:
its fast paths (bytes, the fused kernel) only answer "equal"; a difference is judged by value and
must reach the final report. Byte-differing blocks of equal value (what a checkpoint load makes
of about 5% of blocks) pass; a changed value, a changed scale, and a NaN where the main shard has
a number (issue 32.5) are named. At stride > 1 on rows of a multiple of 128 elements (the usual
shape in real models: their scale rows have no tile padding) the sampled blocks' scales are read
at their real positions, not as if contiguous. The kit's TE-shaped type, and bf16 params."""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.testing.te_mxfp8 import TEShapedMXFP8Quantizer
from mbridge_mxfp8_plugin.verify import fused
from mbridge_mxfp8_plugin.verify.batches import Owned
from mbridge_mxfp8_plugin.verify.probe import Probed
from mbridge_mxfp8_plugin.verify.read import BLOCK, Reader, reader_for
from mbridge_mxfp8_plugin.verify.report import WeightReport
from mbridge_mxfp8_plugin.verify.shard import ShardCheck

#: The two judges of codes: the fused kernel where it can run here, and the type's own write.
PATHS = [
    pytest.param(
        "fused",
        marks=pytest.mark.skipif(not fused.available(torch.device("cpu")), reason="no fused kernel here"),
    ),
    "own write",
]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "own write":
        monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    return request.param


def _param() -> tuple[torch.Tensor, torch.Tensor]:
    """A TE-shaped (64, 128) param and its fp32 main: block 0 of row 0 all ones (TE's rule gives
    codes 256 at scale 2**-8), the rest random."""
    torch.manual_seed(0)
    values = (torch.randn(64, 128) * 0.02).to(torch.bfloat16)
    values[0, :32] = 1.0
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
    return param, values.float().reshape(-1)


def _check(
    param: torch.Tensor,
    main: torch.Tensor,
    budget: int = 64 << 20,
    *,
    stride: int = 1,
    offset: int = 0,
    atol: float = 0.0,
    probed: Probed | None = None,
) -> WeightReport:
    report = WeightReport(event="test")
    check = ShardCheck(report, atol=atol, stride=stride, offset=offset, budget_bytes=budget, probed=probed)
    reader = reader_for(param) if hasattr(param, "_rowwise_data") else Reader(param.reshape(-1))
    assert not isinstance(reader, str)
    mxfp8 = reader.scales is not None
    check.add("w", param, reader, Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=mxfp8)
    check.finish(max_names=5)
    return report


def _code(value: float) -> int:
    return int(torch.tensor([value]).to(torch.float8_e4m3fn).view(torch.uint8))


def test_equal_bytes_pass() -> None:
    param, main = _param()
    report = _check(param, main)
    assert report.ok and report.params_checked == 1 and not report.unchecked
    assert report.elements_checked == main.numel()


def test_reencoded_block_passes_by_value() -> None:
    param, main = _param()
    codes, scales = param._rowwise_data, param._rowwise_scale_inv
    assert int(codes[0, 0]) == _code(256.0)
    # The same values with half the codes and twice the scale: other bytes, equal values.
    codes[0, :32] = _code(128.0)
    scales[0, 0] += 1
    assert torch.equal(param.dequantize()[0, :32], torch.ones(32, dtype=torch.bfloat16))
    for budget in (64 << 20, 1):  # one batch; the smallest batches (32 blocks each)
        report = _check(param, main, budget)
        assert report.ok, report.message()


def test_changed_value_in_a_byte_differing_batch_is_named() -> None:
    param, main = _param()
    param._rowwise_data[0, :32] = _code(128.0)
    param._rowwise_scale_inv[0, 0] += 1  # equal values, other bytes ...
    param._rowwise_data[5, 40] ^= 0x01  # ... and one element whose value changed
    report = _check(param, main)
    assert not report.ok
    assert report.shard_mismatch_count == 1
    assert report.shard_mismatches[0].name == "w" and report.shard_mismatches[0].elements == 1


def test_changed_scale_is_caught() -> None:
    param, main = _param()
    param._rowwise_scale_inv[3, 1] += 1  # every element of that block doubles
    report = _check(param, main)
    assert not report.ok and report.shard_mismatches[0].elements > 0


# ------------------------------------------------------------------ NaN reaches the final report
def test_a_nan_in_a_param_where_the_main_shard_has_a_number_is_wrong(path: str) -> None:
    """Issue 32.5: the kernel counts it, and so must the value re-judge of the flagged batch
    (``_attribute.Attribution``), which is what fills the report: a NaN never compares equal."""
    param, main = _param()
    param._rowwise_data[5, 40] = 0x7F  # E4M3 NaN; the main shard holds a number there
    report = _check(param, main)
    assert not report.ok and report.shard_mismatch_count == 1, report.message()
    (m,) = report.shard_mismatches
    assert m.name == "w" and m.elements == 1 and m.max_abs_diff == float("inf")
    assert any(("fused" in p) == (path == "fused") for p in report.reference_paths), report.reference_paths


def test_nan_on_both_sides_at_the_same_place_is_equal(path: str) -> None:
    """docs/verify.md: a param holding NaN where its main shard does is current (the check judges
    currency, not finiteness). The type is probed on the finite weights of an earlier check, as
    in a job whose weights went NaN after its first check."""
    param, main = _param()
    probed = Probed()
    assert _check(param, main, probed=probed).ok
    main[5 * 128 + 40] = float("nan")
    values = main.view(64, 128).to(torch.bfloat16)
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
    assert int(param._rowwise_data[5, 40]) & 0x7F == 0x7F
    report = _check(param, main, probed=probed)
    assert report.ok and report.params_checked == 1, report.message()


def test_a_nan_of_the_other_sign_is_equal_once_its_bytes_are_judged_by_value(path: str) -> None:
    """A NaN whose sign differs from the main shard's (conversions disagree on the sign a NaN
    keeps): the bytes differ, so the batch is judged again by value, where NaN on both sides is
    equal, as in the fused kernel's byte compare."""
    param, main = _param()
    probed = Probed()
    assert _check(param, main, probed=probed).ok
    main[5 * 128 + 40] = float("nan")
    values = main.view(64, 128).to(torch.bfloat16)
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
    param._rowwise_data[5, 40] ^= 0x80
    report = _check(param, main, probed=probed)
    assert report.ok and report.params_checked == 1, report.message()


@pytest.mark.parametrize("atol", [0.0, 1e-3])
def test_a_nan_in_a_bf16_param_is_wrong_exact_or_within_atol(atol: float) -> None:
    """The value path (bf16 params, value-holding types): the batch verdict and the per-param
    count both see the NaN, with ``atol`` 0 (``!=``) and above (``<= atol`` is false for NaN)."""
    torch.manual_seed(1)
    main = torch.randn(16 * 64)
    param = main.to(torch.bfloat16)
    assert _check(param, main, atol=atol).ok
    param[3 * 64 + 7] = float("nan")
    report = _check(param, main, atol=atol)
    assert not report.ok and report.shard_mismatch_count == 1, report.message()
    assert report.shard_mismatches[0].elements == 1


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("atol", [0.0, 1e-3])
def test_nan_and_inf_on_both_sides_of_a_bf16_param_are_equal(
    atol: float, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/verify.md: the check judges whether the weights are current, not whether they are
    finite, so a job whose weights went NaN or inf does not read as a sync defect: NaN, inf and
    -inf on both sides at the same place are equal, exact and within ``atol``, through the values
    kernel and through torch's compare, as the byte compares judge them. A changed value beside
    them is still the one difference, named with its own difference (not an infinity from the
    NaNs); a NaN against a number: ``test_a_nan_in_a_bf16_param_is_wrong_exact_or_within_atol``."""
    from mbridge_mxfp8_plugin.verify import _values_kernel

    launched = []
    if kernel:
        if not fused.available(torch.device("cpu")):
            pytest.skip("no values kernel here")
        real = _values_kernel.items_kernel
        monkeypatch.setattr(_values_kernel, "items_kernel", _Counted(real, launched))
    else:
        monkeypatch.setenv("MXFP8_VERIFY_TRITON", "0")
    torch.manual_seed(1)
    main = torch.randn(16 * 64)
    main[5], main[70], main[200], main[3 * 64 + 7] = float("nan"), float("inf"), float("-inf"), 1.0
    param = main.to(torch.bfloat16)
    assert _check(param, main, atol=atol).ok
    param[3 * 64 + 7] = 1.5
    report = _check(param, main, atol=atol)
    assert not report.ok and report.shard_mismatch_count == 1, report.message()
    (m,) = report.shard_mismatches
    assert m.elements == 1 and m.max_abs_diff == 0.5
    assert bool(launched) == kernel


class _Counted:
    """A Triton kernel whose launches (``kernel[grid]``) are recorded."""

    def __init__(self, kernel: object, launched: list[object]) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid: object) -> object:
        self.launched.append(grid)
        return self.kernel[grid]  # type: ignore[index]


# ---------------------------------------------------- sampled scales on rows of 128k elements
ROWS, LAST, STRIDE = 64, 256, 16  # 8 blocks a row: scale rows unpadded (TE pads to 4 columns)


def _wide_param() -> tuple[torch.Tensor, torch.Tensor]:
    """A TE-shaped (64, 256) param whose blocks all have other scales (amax 2**-8 .. 2**8 at
    random), written by TE's rule from its fp32 main."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randn(ROWS, LAST // BLOCK, BLOCK, generator=gen)
    blocks *= torch.exp2(torch.randint(-8, 9, (ROWS, LAST // BLOCK, 1), generator=gen).float())
    values = blocks.reshape(ROWS, LAST).to(torch.bfloat16)
    param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
    return param, values.float().reshape(-1)


def test_wide_param_has_unpadded_scale_rows_of_varied_bytes() -> None:
    """The preconditions: the reader sees one scale byte per block (no padding columns: the
    strided read), and neighbouring blocks' scales differ (a contiguous misread would show)."""
    param, _ = _wide_param()
    reader = reader_for(param)
    assert isinstance(reader, Reader) and reader.scale_cols == LAST // BLOCK
    scales = param._rowwise_scale_inv[:ROWS].reshape(-1)
    assert (scales[1:] != scales[:-1]).float().mean() > 0.8


@pytest.mark.parametrize("offset", range(STRIDE))
def test_sampled_scales_of_whole_tile_rows_read_at_their_positions(path: str, offset: int) -> None:
    """Issue 32.5: at the default sample (1/16) on rows of 256 elements the current param
    passes at every phase, and one sampled block's corrupted scale is named with exactly that
    block's elements (each of them doubles), by the phase that samples it only."""
    param, main = _wide_param()
    clean = _check(param, main, stride=STRIDE, offset=offset)
    assert clean.ok, clean.message()
    assert clean.elements_checked == ROWS * LAST // STRIDE
    bad = 5 * (LAST // BLOCK) + 3  # global block 43: sampled where offset % 16 == 11
    row, col = divmod(bad, LAST // BLOCK)
    nonzero = int((main.view(ROWS, LAST)[row, col * BLOCK : (col + 1) * BLOCK] != 0).sum())
    param._rowwise_scale_inv[row, col] += 1
    report = _check(param, main, stride=STRIDE, offset=offset)
    if offset != bad % STRIDE:
        assert report.ok, report.message()  # not a sampled block at this phase
        return
    assert not report.ok and report.shard_mismatch_count == 1, report.message()
    assert report.shard_mismatches[0].elements == nonzero > 0, report.message()


# ------------------------------------------- a sample costs its sample on the own-write path
@pytest.mark.parametrize("budget", [64 << 20, 160_000])  # one batch; 256-block batches
def test_a_sampled_check_writes_once_per_batch_across_params(
    monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    """Issue 32.2: on the type's own write path a sampled check of many params of one type
    writes each batch's sampled rows once (a batch holds many params' rows), not once per param
    or per budget slice of each param, at every phase of the rotation; and only sampled rows."""
    monkeypatch.setenv("MXFP8_VERIFY_FUSED", "0")
    stride, count = 16, 24
    params = []
    for i in range(count):
        torch.manual_seed(i)
        values = (torch.randn(64, 256) * 0.02).to(torch.bfloat16)  # 512 blocks: 32 sampled
        param = TEShapedMXFP8Quantizer(rowwise=True, columnwise=False).quantize(values)
        params.append((f"w{i}", param, values.float().reshape(-1)))
    check = ShardCheck(WeightReport(event="t"), atol=0.0, stride=stride, offset=0, budget_bytes=budget)
    for name, param, main in params:
        reader = reader_for(param)
        assert isinstance(reader, Reader)
        check.add(name, param, reader, Owned(main, 0, main.numel(), torch.bfloat16), mxfp8=True)
    (reference,) = check.references.values()
    rows: list[int] = []
    write = reference.write

    def counted(dst: object, src: torch.Tensor) -> None:
        rows.append(src.shape[0])
        write(dst, src)

    monkeypatch.setattr(reference, "write", counted)
    for offset in range(stride):
        report = WeightReport(event="t")
        check.restart(report, offset)
        check.finish(max_names=5)
        assert report.ok and report.params_checked == count, report.message()
    batches = len(check.planned)
    assert batches == (1 if budget > 1 << 20 else 3)  # 768 sampled blocks; 256 a batch
    assert all(len({it.slot for it in b.items}) >= 8 for b in check.planned)  # many params a batch
    assert len(rows) == stride * batches, rows  # one write per batch per call
    assert sum(rows) == stride * count * 512 // stride  # only the sampled rows (whole 32-row tiles)


def test_verdicts_that_fill_the_flags_are_read_from_them_without_a_copy() -> None:
    """``_flags.stack_verdicts``: verdicts that are each their own slot of the call's flags, and
    fill it, are that tensor (no stack kernel, no graph node), put in slot order; any other
    verdict (a copy, a slot twice, another tensor) gets a stack, in the verdicts' own order."""
    from mbridge_mxfp8_plugin.verify._flags import stack_verdicts

    flags = torch.tensor([3, 0, 5], dtype=torch.int32)
    batches = [object(), object(), object()]
    verdicts = [(batches[0], flags[2]), (batches[1], flags[0]), (batches[2], flags[1])]
    ordered, one = stack_verdicts(verdicts, flags)  # type: ignore[arg-type]
    assert one is flags and [b for b, _ in ordered] == [batches[1], batches[2], batches[0]]
    assert [int(v) for _, v in ordered] == one.tolist()
    for other in ([flags[2], flags[0], flags[1].clone()], [flags[0], flags[0], flags[1]]):
        same, copied = stack_verdicts(list(zip(batches, other, strict=True)), flags)  # type: ignore[arg-type]
        assert copied is not flags and same[0][0] is batches[0]
        assert copied.tolist() == [int(v) for v in other]
    assert stack_verdicts([(batches[0], flags[0])], flags)[1] is not flags  # not every slot
