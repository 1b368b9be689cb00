"""The native bf16 GEMM's three kernels (AMX ``gemm_amx.c``; AVX512-BF16 dot products and fp32 FMAs
over widened weights, ``gemm_bf16.c``) and the packed layout.

Against a float64 reference of the same bf16-rounded inputs (x unrounded for the FMA kernel; so
only the fp32 accumulation's rounding is left: a tight tolerance), over partial panels and tiles,
odd k and k not a whole number of AMX k tiles, more rows than one 256-row chunk, strided rows and
biases; and batch invariance: each row's output is bitwise the same computed alone or within
batches of 1..33 rows, at any offset (and, in the FMA kernel, whether its chunk widened the panel
once or per tile). Each test runs on every kernel this CPU can run: the default build and the
variants (``load_kernels(no_amx=True, bf16_fma=False)``, ``load_kernels(bf16_fma=True)``), since a
process runs one kernel for every call. Skipped on a CPU without AVX512-BF16 (the GEMM is not
built there, and the runner never packs bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.model_runner import native
from services.model_runner.model.packed import PackedWeight, pack_panels_bf16

ROOT = Path(__file__).resolve().parents[2]


def _amx_cpu() -> bool:
    flags = native._cpu_flags().split()
    return "amx_tile" in flags and "amx_bf16" in flags


@pytest.fixture(params=["default", "dots", "fma"])
def kernel_build(request: pytest.FixtureRequest) -> native.NativeKernels:
    """The default build (AMX where the CPU has it; the fp32-FMA kernel on an Intel CPU without it),
    the AVX512-BF16 dot-product kernel's build where the default is another kernel, and the fp32-FMA
    kernel's build where the default is not that one."""
    kernels = native.load_kernels()
    if kernels is None:
        pytest.skip("the native kernels did not build here")
    if kernels.linear_bf16 is None:
        pytest.skip("the CPU has no AVX512-BF16: the native bf16 GEMM is not built here")
    if request.param == "default":
        return kernels
    if request.param == "fma":
        if kernels.linear_bf16_fma:
            pytest.skip("the default build runs the fp32-FMA kernel already (an Intel CPU without AMX)")
        fma = native.load_kernels(bf16_fma=True)
        assert fma is not None and fma.linear_bf16_fma and not fma.linear_bf16_amx
        return fma
    if not kernels.linear_bf16_amx and not kernels.linear_bf16_fma:
        pytest.skip("the default build runs the AVX512-BF16 dot-product kernel already")
    other = native.load_kernels(no_amx=True, bf16_fma=False)
    assert other is not None and other.linear_bf16 is not None and not other.linear_bf16_amx
    assert not other.linear_bf16_fma
    return other


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def test_panel_layout_pairs_k_per_column() -> None:
    """Panel p, pair q holds columns [48p, 48p + 48) as (k = 2q, k = 2q + 1) pairs; zero past the
    last column and past an odd k."""
    weight = torch.arange(100 * 3, dtype=torch.float32).view(100, 3)  # w[c, k] = 3c + k, exact in bf16 below 256
    packed = pack_panels_bf16(weight, 48)
    assert packed.shape == (3, 2, 48, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed[0, 0, 5].tolist() == [15.0, 16.0]  # column 5, k 0 and 1
    assert packed[0, 1, 5].tolist() == [17.0, 0.0]  # k 2, and the padding k 3
    assert packed[1, 0, 1].tolist() == [3.0 * 49, 3.0 * 49 + 1]
    assert torch.equal(packed[2, :, 4:].float(), torch.zeros(2, 44, 2))


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 960, 576), (5, 77, 33), (8, 48, 16), (32, 3072, 576), (17, 576, 1536), (300, 130, 64), (3, 1, 7),
    (9, 50, 1),
])  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_matches_float64_of_the_rounded_inputs(kernel_build: native.NativeKernels, rows: int,
                                                           out_features: int, in_features: int,
                                                           with_bias: bool) -> None:  # fmt: skip
    kernels = kernel_build
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features + 3, generator=gen)[:, 1 : in_features + 1]  # strided rows
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = PackedWeight(weight, bias, "native_bf16", kernels)(x)
    # the fp32-FMA kernel reads x as given; the others round it to bf16 first
    x_in = x.double() if kernels.linear_bf16_fma else _bf16(x)
    expected = torch.nn.functional.linear(x_in, _bf16(weight), None if bias is None else bias.double())
    # the products of two bf16 are exact in fp32; only the fp32 sums round: ~sqrt(k) ulps of the terms
    torch.testing.assert_close(out.double(), expected, atol=2e-5 * in_features**0.5, rtol=1e-5)


def test_rounding_is_at_the_input_not_a_truncation(kernel_build: native.NativeKernels) -> None:
    """x = 1 + 2^-8 + 2^-9 rounds (to nearest even) to 1 + 2^-7 in bf16, not down to 1."""
    kernels = kernel_build
    x = torch.full((1, 2), 1 + 2**-8 + 2**-9)
    out = PackedWeight(torch.ones(1, 2), None, "native_bf16", kernels)(x)
    assert out.item() == (2 * (1 + 2**-8 + 2**-9) if kernels.linear_bf16_fma else 2 * (1 + 2**-7))


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 960, 576), (33, 130, 99), (300, 48, 7)])
def test_fma_kernel_is_bitwise_the_fp32_gemm_over_the_rounded_weights(rows: int, out_features: int,
                                                                       in_features: int) -> None:  # fmt: skip
    """The fp32-FMA kernel: each output sum_k x[k] w[k] in k order with FMA, plus the bias, so bitwise
    gemm.c's fp32 kernel on the bf16-rounded weights (odd k: the last pair's low half alone)."""
    fma = native.load_kernels(bf16_fma=True)
    if fma is None or fma.linear_bf16 is None:
        pytest.skip("the CPU has no AVX512-BF16: the native bf16 GEMM is not built here")
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features + 1, generator=gen)[:, :in_features]
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    out = PackedWeight(weight, bias, "native_bf16", fma)(x)
    fp32 = PackedWeight(weight.to(torch.bfloat16).float(), bias, "native", fma)(x)
    assert torch.equal(out, fp32)


@pytest.mark.parametrize("in_features", [576, 99])
@pytest.mark.parametrize("with_bias", [True, False])
def test_each_row_is_bitwise_the_same_alone_or_in_any_batch(kernel_build: native.NativeKernels, in_features: int,
                                                            with_bias: bool) -> None:  # fmt: skip
    """Batch invariance: rows of one 40-row x, computed in batches of 1..33 rows starting at
    every offset, give bitwise the outputs of each row computed alone (2 threads split the
    panels; the AVX512 kernel's row tiles of 8, the AMX kernel's blocks of 32 and 16 rows, its
    pairs of whole panels and the lone partial fifth, and their partial tails all take part; k = 99
    ends in a partial AMX k tile; without a bias, a whole 32-row block of a pair is stored straight
    into the output)."""
    kernels = kernel_build
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, in_features, generator=gen)
    weight = torch.randn(200, in_features, generator=gen)
    bias = torch.randn(200, generator=gen) if with_bias else None
    packed = PackedWeight(weight, bias, "native_bf16", kernels)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
    for batch in range(1, 34):
        for start in range(0, 40 - batch + 1, 7):
            assert torch.equal(packed(x[start : start + batch]), alone[start : start + batch]), (batch, start)


def test_more_rows_than_a_chunk_are_invariant_too(kernel_build: native.NativeKernels) -> None:
    """300 rows (two 256-row chunks): each row bitwise its value alone."""
    kernels = kernel_build
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(300, 64, generator=gen)
    packed = PackedWeight(torch.randn(130, 64, generator=gen), None, "native_bf16", kernels)
    whole = packed(x)
    for i in (0, 7, 255, 256, 299):
        assert torch.equal(whole[i : i + 1], packed(x[i : i + 1]))


def test_not_offered_without_the_kernel() -> None:
    """``native_bf16`` is refused (not silently fp32) where the bf16 GEMM is not built."""
    kernels = native.load_kernels(portable=True)
    if kernels is None:
        pytest.skip("the native kernels did not build here")
    assert kernels.linear_bf16 is None and not kernels.linear_bf16_amx  # the portable build has no AVX-512 at all
    with pytest.raises(ValueError, match="not built here"):
        PackedWeight(torch.ones(4, 4), None, "native_bf16", kernels)


def _swiglu_unfused(kernels: native.NativeKernels, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    gate_up = packed(x)
    inter = gate_up.shape[1] // 2
    act = torch.empty(x.shape[0], inter)
    kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), x.shape[0], inter)
    return act


def _swiglu_fused(kernels: native.NativeKernels, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    inter = packed.out_features // 2
    act = torch.full((x.shape[0], inter), float("nan"))
    assert isinstance(packed.packed, torch.Tensor) and kernels.linear_bf16_swiglu is not None
    status = kernels.linear_bf16_swiglu(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.packed.data_ptr(), inter,
        None if packed.bias is None else packed.bias.data_ptr(), act.data_ptr(), act.stride(0),
    )  # fmt: skip
    assert status == 0
    return act


@pytest.mark.parametrize(("rows", "inter", "in_features"), [(1, 48, 64), (37, 96, 576), (300, 144, 33), (16, 48, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_is_bitwise_the_gemm_then_swiglu(kernel_build: native.NativeKernels, rows: int, inter: int,
                                                      in_features: int, with_bias: bool) -> None:  # fmt: skip
    """gate_up GEMM + SwiGLU in one kernel: bitwise kvmesh_linear_bf16 then kvmesh_silu_mul_f32,
    over partial row tiles, odd k, two 256-row chunks, with and without the bias."""
    kernels = kernel_build
    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, in_features + 2, generator=gen)[:, 1 : in_features + 1]  # strided rows
    bias = torch.randn(2 * inter, generator=gen) if with_bias else None
    packed = PackedWeight(torch.randn(2 * inter, in_features, generator=gen), bias, "native_bf16", kernels)
    assert torch.equal(_swiglu_fused(kernels, x, packed), _swiglu_unfused(kernels, x, packed))


def test_fused_swiglu_takes_whole_panels_only(kernel_build: native.NativeKernels) -> None:
    """An intermediate size that is not a multiple of the panel width: status -3, nothing written."""
    kernels = kernel_build
    packed = PackedWeight(torch.randn(2 * 40, 16), None, "native_bf16", kernels)
    out = torch.zeros(3, 40)
    assert isinstance(packed.packed, torch.Tensor) and kernels.linear_bf16_swiglu is not None
    x = torch.randn(3, 16)
    status = kernels.linear_bf16_swiglu(x.data_ptr(), 16, 3, 16, packed.packed.data_ptr(), 40, None,
                                        out.data_ptr(), 40)  # fmt: skip
    assert status == -3
    assert torch.equal(out, torch.zeros(3, 40))


def test_amx_is_the_kernel_on_an_amx_cpu() -> None:
    """Where the CPU has AMX-BF16 and Linux grants the tile state, the default build's bf16 GEMMs run
    on AMX, for every call; the build without AMX runs the AVX512-BF16 kernel."""
    if not _amx_cpu():
        pytest.skip("the CPU has no AMX-BF16 (amx_tile, amx_bf16 not in /proc/cpuinfo)")
    if os.environ.get("KVMESH_NATIVE_AMX") == "0":
        pytest.skip("KVMESH_NATIVE_AMX=0 is set for this process")
    kernels, other = native.load_kernels(), native.load_kernels(no_amx=True)
    assert kernels is not None and other is not None
    assert kernels.linear_bf16_amx is True
    assert other.linear_bf16 is not None and other.linear_bf16_amx is False


def test_env_keeps_the_avx512_kernel() -> None:
    """KVMESH_NATIVE_AMX=0 (read when the object loads): the default build runs the AVX512-BF16 kernel."""
    if not _amx_cpu():
        pytest.skip("the CPU has no AMX-BF16: there is nothing to turn off")
    code = (
        "from services.model_runner import native; k = native.load_kernels(); "
        "print(k.linear_bf16 is not None, k.linear_bf16_amx)"
    )
    env = {**os.environ, "KVMESH_NATIVE_AMX": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "True False"  # the bf16 GEMM is there, on the AVX512-BF16 kernel
