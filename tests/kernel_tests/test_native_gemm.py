"""The native fp32 GEMM (``services/model_runner/native/gemm.c``) and its packed layout.

Three builds: the AVX-512 one (8-row tiles, software prefetch of the next panel), the portable
one (``-mno-avx512f``: the AVX2 + FMA tiles on a CPU with FMA, the plain C loops elsewhere) and the
plain one (``-mno-avx2 -mno-fma`` too: the plain C loops on every machine). Shapes
straddle every edge the kernel has: output columns not a multiple of the 48-wide panel, fewer
panels than threads, row counts that leave a partial 8-row tile, and more rows than one 256-row
chunk. Besides closeness to float64, the FMA tiles are pinned bitwise to a scalar loop
(``gemm_reference.c``): the per-output order of the k sum is the contract a faster blocking must keep.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model_runner import native
from services.model_runner.model.packed import PackedWeight, pack_panels

VARIANTS = ["native", "portable", "plain"]


def _kernels(variant: str) -> native.NativeKernels:
    kernels = native.load_kernels(portable=variant == "portable", plain=variant == "plain")
    assert kernels is not None, "the native kernels did not build on this machine"
    return kernels


def _linear(kernels: native.NativeKernels, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    packed = pack_panels(weight, kernels.panel_width)
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"))
    kernels.linear(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), weight.shape[0],
                   None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))  # fmt: skip
    return out


def test_panel_layout() -> None:
    """Panel p holds columns [48p, 48p + 48) as k rows of 48, zero past the last column."""
    weight = torch.arange(100 * 3, dtype=torch.float32).view(100, 3)  # w[c, k] = 3c + k
    packed = pack_panels(weight, 48)
    assert packed.shape == (3, 3, 48) and packed.is_contiguous()
    assert packed[0, 2, 5].item() == 3 * 5 + 2
    assert packed[2, 1, 3].item() == 3 * 99 + 1  # column 99 = panel 2, lane 3
    assert torch.equal(packed[2, :, 4:], torch.zeros(3, 44))
    assert _kernels("native").panel_width == 48


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 960, 576), (5, 77, 33), (8, 48, 16), (32, 3072, 576), (17, 576, 1536), (300, 130, 64), (3, 1, 7),
])  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64(variant: str, rows: int, out_features: int, in_features: int,
                                with_bias: bool) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = _linear(_kernels(variant), x, weight, bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 sums of in_features products: error grows like sqrt(k) ulps of the terms
    torch.testing.assert_close(out.double(), expected, atol=2e-5 * in_features**0.5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows_in_and_out(variant: str) -> None:
    """x may be a column slice of a wider tensor (row stride > k); out rows may be wider too,
    and nothing past each row's n columns is written."""
    kernels = _kernels(variant)
    wide = torch.randn(11, 70)
    x = wide[:, 3:53]  # k = 50, row stride 70
    weight = torch.randn(60, 50)
    packed = pack_panels(weight, kernels.panel_width)
    out = torch.full((11, 64), -7.0)
    kernels.linear(x.data_ptr(), x.stride(0), 11, 50, packed.data_ptr(), 60, None, out.data_ptr(), 64)
    torch.testing.assert_close(out[:, :60], x @ weight.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[:, 60:], torch.full((11, 4), -7.0))


def test_packed_weight_native_mode() -> None:
    """The model's entry point: any row count (none included), non-contiguous x, wrong widths refused."""
    weight, bias = torch.randn(100, 40), torch.randn(100)
    packed = PackedWeight(weight, bias, "native")
    assert packed.mode == "native" and PackedWeight.supported(weight, "native")
    assert not PackedWeight.supported(weight.half(), "native")
    x = torch.randn(40, 9).T  # [9, 40], column stride 9
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert packed(torch.empty(0, 40)).shape == (0, 100)
    with pytest.raises(ValueError, match=r"\[T, 40\]"):
        packed(torch.randn(3, 41))


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_any_thread_count(threads: int) -> None:
    """Threads work in pairs from both ends of a run of panels; an odd count leaves one thread a
    run to itself. Every panel must be computed exactly once whatever the count (this machine's
    2 cores run 3 or 4 OpenMP threads too, just slower)."""
    kernels = _kernels("native")
    gen = torch.Generator().manual_seed(threads)
    x, weight = torch.randn(9, 64, generator=gen), torch.randn(1000, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _linear(kernels, x, weight, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_row_is_bitwise_the_same_alone_or_in_any_batch(variant: str) -> None:
    """Batch invariance: rows of one 300-row x computed in batches of 1..40 rows at several offsets,
    and all 300 at once (two 256-row chunks), give bitwise each row's output computed alone. The
    batches straddle the switch from decode-sized chunks (up to 4 row tiles, the next panel
    prefetched in the k loop) to prefill-sized ones (no prefetch): only the schedule may differ."""
    kernels = _kernels(variant)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 576, generator=gen)
    weight, bias = torch.randn(200, 576, generator=gen), torch.randn(200, generator=gen)
    alone = torch.cat([_linear(kernels, x[i : i + 1], weight, bias) for i in range(300)])
    for batch in (*range(1, 41), 300):
        for start in range(0, min(41, 300 - batch + 1), 13):
            assert torch.equal(_linear(kernels, x[start : start + batch], weight, bias),
                               alone[start : start + batch]), (batch, start)  # fmt: skip


def _has_fma() -> bool:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith("flags") and "fma" in line.split() for line in lines)


@functools.cache
def _reference() -> Any:
    """gemm_reference.c's scalar loop, built as the kernels are (native.build, its own cache key)."""
    lib = ctypes.CDLL(str(native.build(sources=(Path(__file__).with_name("gemm_reference.c"),))))
    fn = lib.reference_linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # fmt: skip
    return fn


# NOTE: the plain-C loops (a CPU without AVX2 + FMA, the "plain" build) multiply and add separately,
# so the contract below is the FMA tiles' (AVX-512, AVX2 + FMA): the two FMA builds on such a CPU.
@pytest.mark.skipif(not _has_fma(), reason="the FMA tiles are built only for a CPU with FMA")
@pytest.mark.parametrize("variant", ["native", "portable"])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "pad"), [
    (1, 960, 576, 0), (5, 77, 33, 3), (8, 48, 16, 0), (32, 1536, 576, 0), (17, 576, 1536, 5), (300, 130, 64, 1),
    (3, 1, 7, 0), (9, 97, 1, 2), (40, 200, 100, 0),
])  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_output_is_the_fma_chain_in_k_order(variant: str, rows: int, out_features: int, in_features: int,
                                                 pad: int, with_bias: bool) -> None:  # fmt: skip
    """Bitwise against the scalar reference (gemm_reference.c): every output is the FMA chain over
    k in order from zero, then the bias, whatever the row tile, panel, chunk or thread. This is
    what the fp32 exact mode rests on (a row's bits never depend on the batch) and what a change
    of the kernel's blocking, loop order or prefetch must keep (x and out rows strided, panels and
    row tiles partial, more rows than one chunk)."""
    kernels = _kernels(variant)
    gen = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    wide = torch.randn(rows, in_features + pad, generator=gen)
    x = wide[:, :in_features]  # row stride in_features + pad
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    packed = pack_panels(weight, kernels.panel_width)
    out, expected = (torch.full((rows, out_features + pad), float("nan")) for _ in range(2))
    args = (x.data_ptr(), x.stride(0), rows, in_features, packed.data_ptr(), out_features)
    bias_ptr = None if bias is None else bias.data_ptr()
    kernels.linear(*args, bias_ptr, out.data_ptr(), out.stride(0))
    _reference()(*args, kernels.panel_width, bias_ptr, expected.data_ptr(), expected.stride(0))
    assert torch.equal(out[:, :out_features].view(torch.int32), expected[:, :out_features].view(torch.int32))


def _swiglu(kernels: native.NativeKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            fused: bool) -> torch.Tensor:  # fmt: skip
    """act = silu(gate) * up of the merged gate_up ``weight`` [2 inter, k]: the fused kernel, or the
    GEMM then the SwiGLU pass."""
    inter = weight.shape[0] // 2
    act = torch.full((x.shape[0], inter), float("nan"))
    if not fused:
        gate_up = _linear(kernels, x, weight, bias)
        kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), x.shape[0], inter)
        return act
    packed = pack_panels(weight, kernels.panel_width)
    bias_ptr = None if bias is None else bias.data_ptr()
    status = kernels.linear_f32_swiglu(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), inter,
                                       bias_ptr, act.data_ptr(), act.stride(0))  # fmt: skip
    assert status == 0
    return act


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("rows", "inter", "in_features"), [(1, 48, 64), (37, 96, 576), (300, 144, 33), (7, 48, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_is_bitwise_the_gemm_then_swiglu(variant: str, rows: int, inter: int, in_features: int,
                                                      with_bias: bool) -> None:  # fmt: skip
    """fp32 gate_up GEMM + SwiGLU in one kernel: bitwise kvmesh_linear_f32 then kvmesh_silu_mul_f32
    in every build, over partial row tiles, odd k, two 256-row chunks, strided rows, with and without
    the bias; and within fp32 rounding of silu(gate) * up in float64."""
    kernels = _kernels(variant)
    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, in_features + 2, generator=gen)[:, 1 : in_features + 1]  # strided rows
    weight = torch.randn(2 * inter, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(2 * inter, generator=gen) if with_bias else None
    fused = _swiglu(kernels, x, weight, bias, fused=True)
    assert torch.equal(fused, _swiglu(kernels, x, weight, bias, fused=False))
    gate_up = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(fused.double(), want, rtol=1e-5, atol=1e-5)


def test_fused_swiglu_takes_whole_panels_only() -> None:
    """An intermediate size that is not a multiple of the panel width: status -3, nothing written."""
    kernels = _kernels("native")
    packed = pack_panels(torch.randn(2 * 40, 16), kernels.panel_width)
    out = torch.zeros(3, 40)
    x = torch.randn(3, 16)
    status = kernels.linear_f32_swiglu(x.data_ptr(), 16, 3, 16, packed.data_ptr(), 40, None, out.data_ptr(), 40)
    assert status == -3
    assert torch.equal(out, torch.zeros(3, 40))
