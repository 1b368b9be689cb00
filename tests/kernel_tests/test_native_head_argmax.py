"""``native/head_argmax.c`` through ``PackedWeight.argmax``: each row's argmax of the packed GEMM's
logits, block by block without writing them, against ``sampler.greedy_tokens`` of the logits the
same packed weight writes (numpy's argmax: the first maximum, a NaN counting as the maximum). Each
case runs on the build this CPU loads and on the ``-mno-avx512f`` one (the AVX2 fold where the CPU
has AVX-512), and the ``plain`` build (no AVX2) must decline."""

from __future__ import annotations

import pytest
import torch

from services.model_runner.model import packed as packed_module
from services.model_runner.model.packed import PackedWeight
from services.model_runner.native import NativeKernels, load_kernels
from services.model_runner.sampler import greedy_tokens

KERNELS = load_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or KERNELS.linear_argmax is None,
                                reason="no AVX-512 or AVX2 build of the native kernels here")  # fmt: skip
BUILDS = ("loaded", "portable")


def _kernels(build: str, mode: str) -> NativeKernels:
    kernels = KERNELS if build == "loaded" else load_kernels(portable=True)
    assert kernels is not None and kernels.linear_argmax is not None
    if mode == "native_bf16" and kernels.linear_bf16 is None:  # the -mno-avx512f build on an AVX512-BF16 CPU
        pytest.skip("this build has no bf16 GEMM")
    return kernels


def _modes() -> list[str]:
    return ["native", *(["native_bf16"] if KERNELS is not None and KERNELS.linear_bf16 is not None else [])]


def _check(head: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    tokens = head.argmax(x)
    assert tokens is not None and tokens.dtype == torch.int64
    assert torch.equal(tokens, greedy_tokens(head(x)))
    return tokens


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("block_floats", [packed_module.ARGMAX_BLOCK_FLOATS, 2 * 48 * 64, 48])
def test_argmax_is_the_logits_argmax(build: str, mode: str, block_floats: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 1-300 (more than the GEMM's 256-row chunk), a vocabulary of part panels, an odd k (bf16's
    last pair half), a bias; the logit blocks as large as the default and as small as one panel."""
    monkeypatch.setattr(packed_module, "ARGMAX_BLOCK_FLOATS", block_floats)
    kernels = _kernels(build, mode)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1000, 37, generator=gen), torch.randn(1000, generator=gen)
    for b in (None, bias):
        head = PackedWeight(weight, b, mode, kernels)
        for m in (1, 7, 33, 300):
            _check(head, torch.randn(m, 37, generator=gen))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("mode", _modes())
def test_ties_nan_and_minus_infinity_as_numpy(build: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal weight rows give equal logits: the first column wins, within a 16-lane vector, within
    and across 8-lane ones, across blocks (96 columns each here) and in a block's last columns past
    the whole vectors; a NaN logit wins from its first column, in a vector or in those last columns;
    a row of -inf only is column 0."""
    kernels = _kernels(build, mode)
    monkeypatch.setattr(packed_module, "ARGMAX_BLOCK_FLOATS", 2 * 48 * 4)  # 4 rows: blocks of 96 columns
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=gen) * 0.01
    top = torch.full((16,), 0.5)
    for col in (250, 130, 17, 5):  # the same best weight row at four columns, last one written first
        weight[col] = top
    x = torch.ones(4, 16)
    head = PackedWeight(weight, None, mode, kernels)
    assert _check(head, x).tolist() == [5] * 4
    nan_weight = weight.clone()
    nan_weight[200, 3] = float("nan")
    nan_weight[120, 0] = float("nan")
    assert _check(PackedWeight(nan_weight, None, mode, kernels), x).tolist() == [120] * 4
    minus_inf = PackedWeight(weight, torch.full((300,), float("-inf")), mode, kernels)
    assert _check(minus_inf, torch.zeros(4, 16)).tolist() == [0] * 4  # logits 0 + -inf
    zeros = PackedWeight(torch.zeros(300, 16), None, mode, kernels)
    signed = torch.tensor([[-1.0] * 16])
    assert _check(zeros, signed).tolist() == [0]  # every logit equal: the first column
    # the last block is columns 288-299: one 8-lane vector, then 296-299 one at a time
    low = torch.randn(300, 16, generator=gen) * 0.01
    for cols, expected in (((299, 297), 297), ((298, 290), 290), ((293, 297), 293)):
        tail = low.clone()
        for col in cols:
            tail[col] = top
        assert _check(PackedWeight(tail, None, mode, kernels), x).tolist() == [expected] * 4
    tail_nan = low.clone()
    tail_nan[298, 7] = float("nan")
    assert _check(PackedWeight(tail_nan, None, mode, kernels), x).tolist() == [298] * 4


def test_other_modes_and_empty_steps() -> None:
    plain = load_kernels(plain=True)  # no AVX2: the caller keeps the logits path
    assert plain is not None and plain.linear_argmax is None
    assert PackedWeight(torch.randn(96, 32), None, "native", plain).argmax(torch.randn(2, 32)) is None
    weight = torch.randn(96, 32)
    assert PackedWeight(weight, None, "native_q8_0", KERNELS).argmax(torch.randn(2, 32)) is None
    assert PackedWeight(weight, None, "native", KERNELS).argmax(torch.randn(0, 32)).tolist() == []
