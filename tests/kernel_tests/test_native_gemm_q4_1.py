"""The native weight-only Q4_1 / Q8_0 GEMM (``services/model_runner/native/gemm_q4_1.c``), its
quantization rules and its packed layout.

The kernel's contract is exact: its output is bitwise ``gemm.c``'s fp32 GEMM over the weights
``dequantize_groups`` gives (``fl(fl(d * q) + m)``), for one row (dequantized in registers) and
for more (each panel dequantized once into an fp32 copy), on the three builds (AVX-512, AVX2 +
FMA, plain C) — so each row's bits are also independent of its batch. The quantization rules
are pinned on hand-made groups, and a weight already on the grid comes back exactly.
"""

from __future__ import annotations

import pytest
import torch

from services.model_runner import native
from services.model_runner.model.packed import (
    PackedWeight,
    dequantize_groups,
    pack_panels,
    pack_q_groups,
    quantize_q4_1,
    quantize_q8_0,
)

VARIANTS = ["native", "portable", "plain"]
QUANTIZE = {"native_q4_1": quantize_q4_1, "native_q8_0": quantize_q8_0}
GROUP = 32


def _kernels(variant: str = "native") -> native.NativeKernels:
    kernels = native.load_kernels(portable=variant == "portable", plain=variant == "plain")
    if kernels is None:
        pytest.skip("the native kernels did not build here")
    return kernels


def _fp32_over_dequantized(kernels: native.NativeKernels, x: torch.Tensor, weight: torch.Tensor, mode: str,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """gemm.c's fp32 GEMM (same build) over the weights the grouped kernel must compute on."""
    dense = dequantize_groups(*QUANTIZE[mode](weight, GROUP), GROUP)
    packed = pack_panels(dense, kernels.panel_width)
    out = torch.empty(x.shape[0], weight.shape[0])
    kernels.linear(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), weight.shape[0],
                   None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))
    return out


def test_group_size_is_the_kernels() -> None:
    assert _kernels().q_group == GROUP


def test_q4_1_rule_on_a_hand_made_group() -> None:
    """d = (max - min) / 15 and m = min, both rounded to f16; codes round((w - m) / d) in 0..15,
    half to even; a constant group gets d = 0 and codes 0 (no division by zero)."""
    row = torch.tensor([[-1.0 + 0.25 * i for i in range(16)] * 2, [3.0] * 32, [0.0, 0.1] * 16])
    codes, d, m = quantize_q4_1(row, GROUP)
    assert codes.dtype == torch.uint8 and d.shape == m.shape == (3, 1)
    assert d[:, 0].tolist() == [0.25, 0.0, torch.tensor(0.1 / 15).half().item()]
    assert m[:, 0].tolist() == [-1.0, 3.0, 0.0]
    assert codes[0].tolist() == list(range(16)) * 2
    assert codes[1].tolist() == [0] * 32
    assert codes[2].tolist() == [0, 15] * 16
    assert dequantize_groups(codes, d, m, GROUP)[0].tolist() == row[0].tolist()


def test_q8_0_rule_on_a_hand_made_group() -> None:
    """d = max |w| / 127 rounded to f16, codes round(w / d) in -127..127, m = 0."""
    row = torch.tensor([[0.5 * (i - 16) for i in range(32)], [0.0] * 32])
    codes, d, m = quantize_q8_0(row, GROUP)
    assert codes.dtype == torch.int8 and m.tolist() == [[0.0], [0.0]]
    assert d[:, 0].tolist() == [torch.tensor(8.0 / 127).half().item(), 0.0]
    assert codes[0, 0].item() == -127 and codes[1].tolist() == [0] * 32
    assert codes[0, 16].item() == 0 and codes[0, 17].item() == round(0.5 / d[0, 0].item())


@pytest.mark.parametrize("mode", sorted(QUANTIZE))
def test_a_weight_on_the_grid_comes_back_exactly(mode: str) -> None:
    """A checkpoint dequantized from such a file (the embedded SmolLM2: Q4_1 projections, a Q8_0
    head) loses nothing when quantized again, including a short last group (k = 70)."""
    torch.manual_seed(1)
    on_grid = dequantize_groups(*QUANTIZE[mode](torch.randn(50, 70), GROUP), GROUP)
    assert torch.equal(dequantize_groups(*QUANTIZE[mode](on_grid, GROUP), GROUP), on_grid)


def test_q4_1_packed_layout() -> None:
    """Per panel and group: d [48] fp32, m [48] fp32, then 32 rows of 24 bytes, column c in the low
    nibble of byte c and column c + 24 in the high one; zero past the last column and past k."""
    out_features, in_features = 50, 40  # two panels, two groups (the second 8 rows long)
    codes = (torch.arange(out_features * in_features) % 16).to(torch.uint8).view(out_features, in_features)
    d = torch.arange(out_features * 2, dtype=torch.float32).view(out_features, 2) + 0.5
    m = -d
    packed = pack_q_groups(codes, d, m, bits=4, width=48, group=GROUP)
    group_bytes = 2 * 48 * 4 + 32 * 24
    assert packed.dtype == torch.uint8 and packed.numel() == 2 * 2 * group_bytes
    groups = packed.view(2, 2, group_bytes)
    scales = groups[..., : 2 * 48 * 4].contiguous().view(torch.float32).view(2, 2, 2, 48)
    assert scales[0, 1, 0, 5].item() == d[5, 1].item() and scales[0, 1, 1, 5].item() == m[5, 1].item()
    assert scales[1, 0, 0, 1].item() == d[49, 0].item() and scales[1, 0, :, 2:].abs().sum().item() == 0.0
    rows = groups[..., 2 * 48 * 4 :].reshape(2, 2, 32, 24)
    assert rows[0, 0, 3, 5].item() == codes[5, 3].item() | (codes[29, 3].item() << 4)
    assert rows[0, 1, 7, 0].item() == codes[0, 39].item() | (codes[24, 39].item() << 4)
    assert rows[0, 1, 8:].sum().item() == 0  # k rows past 40
    assert rows[1, 0, 2, 1].item() == codes[49, 2].item()  # column 49's partner (73) is past n


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", sorted(QUANTIZE))
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (100, 70), (49, 576)])
def test_bitwise_fp32_gemm_over_the_dequantized_weights(variant: str, mode: str, out_features: int,
                                                        in_features: int) -> None:
    """One row (in registers where the build vectorizes), a few, and a prefill chunk past one
    256-row chunk, with a bias and without: bitwise gemm.c over ``dequantize_groups``' weights."""
    kernels = _kernels(variant)
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    for bias in (None, torch.randn(out_features)):
        packed = PackedWeight(weight, bias, mode, kernels)
        for rows in (1, 2, 7, 33, 300):
            x = torch.randn(rows, in_features)
            assert torch.equal(packed(x), _fp32_over_dequantized(kernels, x, weight, mode, bias)), (rows, bias is None)


@pytest.mark.parametrize("mode", sorted(QUANTIZE))
def test_each_row_is_bitwise_the_same_alone_or_in_any_batch(mode: str) -> None:
    kernels = _kernels()
    torch.manual_seed(3)
    packed = PackedWeight(torch.randn(144, 96), torch.randn(144), mode, kernels)
    x = torch.randn(40, 96)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
    for start, rows in ((0, 40), (5, 3), (11, 29)):
        assert torch.equal(packed(x[start : start + rows]), alone[start : start + rows])


@pytest.mark.parametrize("threads", [1, 2])
def test_any_thread_count(threads: int) -> None:
    kernels = _kernels()
    torch.manual_seed(4)
    weight = torch.randn(200, 64)
    packed = PackedWeight(weight, None, "native_q4_1", kernels)
    x = torch.randn(9, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.cat([packed(x[:1]), packed(x)])
    finally:
        torch.set_num_threads(before)
    want = _fp32_over_dequantized(kernels, x, weight, "native_q4_1", None)
    assert torch.equal(got, torch.cat([want[:1], want]))


def test_pack_refuses_an_unknown_width() -> None:
    codes, d, m = quantize_q4_1(torch.randn(4, 32), GROUP)
    with pytest.raises(ValueError, match="bits must be 4 or 8 and width even, got 3 and 48"):
        pack_q_groups(codes, d, m, bits=3, width=48, group=GROUP)
