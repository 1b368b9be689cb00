"""The native weight-only int8 GEMM (``services/model_runner/native/gemm_int8.c``), its quantization
rule and its packed layout.

The kernel against a float64 torch reference of the same quantized math (``quantize_int8``'s int8
weights and scales, the bf16-rounded input: ``(bf16(x) @ q^T) * scale + b``), so only the fp32
accumulation's rounding is left: a tight tolerance. Batch invariance: each row's output is
bitwise the same alone or within batches of 1..33 rows at any offset, across the decode path
(weights widened in registers, up to 8 rows) and the prefill path (each panel widened once into
a bf16 copy, more rows) and across 256-row chunks. Skipped on a CPU without AVX512-BF16 (the
kernel is not built there, and the runner refuses ``int8_weight_only``).
"""

from __future__ import annotations

import pytest
import torch

from services.model_runner import native
from services.model_runner.model.packed import PackedWeight, pack_int8, quantize_int8


def _kernels() -> native.NativeKernels:
    kernels = native.load_kernels()
    if kernels is None:
        pytest.skip("the native kernels did not build here")
    if kernels.linear_int8 is None:
        pytest.skip("the CPU has no AVX512-BF16: the native int8 GEMM is not built here")
    return kernels


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    q, scales = quantize_int8(weight)
    out = (x.to(torch.bfloat16).double() @ q.double().T) * scales.double()
    return out if bias is None else out + bias.double()


def test_quantization_is_symmetric_per_output_channel() -> None:
    """scale = max |w| / 127 per row; q = round half to even of w / scale; an all-zero row gets
    scale 1 and q 0 (no division by zero)."""
    weight = torch.tensor([[127.0, -63.5, 0.5, -127.0], [2.54, 1.27, -0.635, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.tolist() == pytest.approx([1.0, 0.02, 1.0])
    assert q.tolist() == [[127, -64, 0, -127], [127, 64, -32, 0], [0, 0, 0, 0]]  # -63.5 and 0.5: to even


def test_packed_layout_is_the_scales_then_bf16_panels_in_int8() -> None:
    """Scales padded to whole panels as fp32 bytes, then panel p, pair c holds columns
    [48p, 48p + 48) as (k = 2c, k = 2c + 1) int8 pairs; zero past the last column and an odd k."""
    q = (torch.arange(100 * 3) % 251 - 125).to(torch.int8).view(100, 3)
    scales = torch.arange(100, dtype=torch.float32) + 0.5
    packed = pack_int8(q, scales, 48)
    assert packed.dtype == torch.uint8 and packed.shape == (3 * 48 * 4 + 3 * 2 * 48 * 2,)
    head = packed[: 3 * 48 * 4].view(torch.float32)
    assert head[:100].tolist() == scales.tolist() and head[100:].tolist() == [0.0] * 44
    panels = packed[3 * 48 * 4 :].view(torch.int8).view(3, 2, 48, 2)
    assert panels[0, 0, 5].tolist() == q[5, :2].tolist()
    assert panels[0, 1, 5].tolist() == [q[5, 2].item(), 0]
    assert panels[1, 0, 1].tolist() == q[49, :2].tolist()
    assert torch.equal(panels[2, :, 4:], torch.zeros(2, 44, 2, dtype=torch.int8))


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 960, 576), (5, 77, 33), (8, 48, 16), (9, 48, 16), (32, 3072, 576), (17, 576, 1536), (300, 130, 64),
    (3, 1, 7), (9, 50, 1),
])  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int8_matches_float64_of_the_same_quantized_math(rows: int, out_features: int, in_features: int,
                                                                with_bias: bool) -> None:  # fmt: skip
    kernels = _kernels()
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features + 3, generator=gen)[:, 1 : in_features + 1]  # strided rows
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = PackedWeight(weight, bias, "native_int8", kernels)(x)
    # bf16 x int8 products are exact in fp32; only the fp32 sums (and the scale's fma) round
    torch.testing.assert_close(out.double(), _reference(x, weight, bias), atol=2e-5 * in_features**0.5, rtol=1e-5)


def test_exact_on_integers() -> None:
    """Small integer inputs and weights whose scale is 1: every sum is exact in fp32, so the
    kernel equals the integer matmul bit for bit (the widening int8 -> bf16 loses nothing)."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (70, 40), generator=gen).float()
    weight[:, 0] = 127.0  # every row's max |w| is 127: scale exactly 1
    x = torch.randint(-8, 9, (11, 40), generator=gen).float()
    out = PackedWeight(weight, None, "native_int8", kernels)(x)
    assert torch.equal(out, (x.long() @ weight.long().T).float())


def test_each_row_is_bitwise_the_same_alone_or_in_any_batch() -> None:
    """Batch invariance: rows of one 40-row x, computed in batches of 1..33 rows starting at
    every seventh offset, give bitwise the outputs of each row computed alone (batches of up to 8
    rows widen the weights in registers, larger ones widen each panel once first)."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 576, generator=gen)
    weight = torch.randn(200, 576, generator=gen)
    packed = PackedWeight(weight, torch.randn(200, generator=gen), "native_int8", kernels)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
    for batch in range(1, 34):
        for start in range(0, 40 - batch + 1, 7):
            assert torch.equal(packed(x[start : start + batch]), alone[start : start + batch]), (batch, start)


def test_more_rows_than_a_chunk_are_invariant_too() -> None:
    """300 rows (two 256-row chunks): each row bitwise its value alone."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(300, 64, generator=gen)
    packed = PackedWeight(torch.randn(130, 64, generator=gen), None, "native_int8", kernels)
    whole = packed(x)
    for i in (0, 7, 255, 256, 299):
        assert torch.equal(whole[i : i + 1], packed(x[i : i + 1]))


def test_not_offered_without_the_kernel() -> None:
    """``native_int8`` is refused (not silently another mode) where the int8 GEMM is not built."""
    kernels = native.load_kernels(portable=True)
    if kernels is None:
        pytest.skip("the native kernels did not build here")
    assert kernels.linear_int8 is None  # the portable build has no AVX-512 at all
    with pytest.raises(ValueError, match="int8 GEMM is not built here"):
        PackedWeight(torch.ones(4, 4), None, "native_int8", kernels)
