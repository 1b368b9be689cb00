"""``native/head_screen.c`` through ``PackedWeight.argmax``: greedy tokens with the vocabulary
scored first in cheaper arithmetic (fp32 mode's head in bf16 or in int8 groups, bf16 mode's in int8
groups, ``native/screen_int8.c``) must be exactly the full head's (``sampler.greedy_tokens`` of the logits
the same packed weight writes: the first maximum). The cases include rows whose scores rank two
columns the other way round from their logits, so a screen that trusted the scores, or bounded
their error too tightly, fails here; ties, non-finite values and rows with too many columns left
take the full head."""

from __future__ import annotations

import pytest
import torch

from services.model_runner.model.head_screen import (
    HeadScreen,
    HeadScreenInt8,
    pack_screen_int8,
    screen_applies,
    screen_bf16_applies,
)
from services.model_runner.model.packed import PackedWeight
from services.model_runner.native import load_kernels
from services.model_runner.sampler import greedy_tokens

KERNELS = load_kernels()
pytestmark = pytest.mark.skipif(
    not screen_applies(KERNELS), reason="no AVX512-BF16 (vdpbf16ps or AMX) build of the native kernels here"
)


BF16 = pytest.mark.skipif(not screen_bf16_applies(KERNELS), reason="no AVX512-VNNI beside the bf16 GEMM here")
INT8 = pytest.mark.skipif(KERNELS is None or KERNELS.head_screen_int8 is None, reason="no AVX512-VNNI build here")
# fp32 mode's two screens: in bf16, and in int8 groups (the default where the CPU has AVX512-VNNI)
FP32_SCREENS = ["bf16", pytest.param("int8", marks=INT8)]


def _head(weight: torch.Tensor, bias: torch.Tensor | None = None, dense: bool = False,
          mode: str = "native", screen: str = "bf16") -> PackedWeight:  # fmt: skip
    """A head packed for ``mode`` with its screen: fp32 mode's in ``screen`` (bf16 or int8)."""
    assert KERNELS is not None
    head = PackedWeight(weight, bias, mode, KERNELS)
    rows = weight if dense else None
    if mode == "native" and screen == "bf16":
        head.screen = HeadScreen(weight, KERNELS, dense=rows)
    else:
        head.screen = HeadScreenInt8(weight, KERNELS, mode, dense=rows)
    return head


def _screened(head: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """The screen's own tokens (asserting it did not hand over to the full head), checked against
    the full fp32 logits' greedy tokens and the head's argmax."""
    assert head.screen is not None
    packed = head.packed
    assert isinstance(packed, torch.Tensor)
    block = 48 * 8  # several blocks a row: the floor carried from block to block
    scratch = torch.empty(x.shape[0] * block)
    out = torch.full((x.shape[0],), -1, dtype=torch.int64)
    assert head.screen.argmax(x, packed, head.bias, scratch, block, out), "the screen handed over to the full head"
    assert torch.equal(out, greedy_tokens(head(x)))
    assert torch.equal(head.argmax(x), out)  # type: ignore[arg-type]
    return out


def _flipped_pair(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two weight rows whose fp32 dot products with x = (1, 1, 0, ...) order one way and whose
    bf16-rounded ones the other: a = (1 + 2^-8 + d, same), rounded up to 1 + 2^-7 each, sums to
    2.0078 (bf16: 2.0156); b = (1 + 2^-7 + 2^-8 - d, 1), rounded down to (1 + 2^-7, 1), sums to
    2.0117 (bf16: 2.0078)."""
    d = 2.0**-14
    a, b = torch.zeros(k), torch.zeros(k)
    a[0] = a[1] = 1 + 2.0**-8 + d
    b[0], b[1] = 1 + 2.0**-7 + 2.0**-8 - d, 1.0
    return a, b


@pytest.mark.parametrize("screen", FP32_SCREENS)
@pytest.mark.parametrize("dense", [False, True])
def test_tokens_are_the_fp32_heads(dense: bool, screen: str) -> None:
    """Rows 1-40 (more than the GEMM's 8-row tile, a part tile), a vocabulary of part panels, an odd
    k (for int8 codes also one of several groups, 96, and one padded to the group, 37), with and
    without a bias, hidden states with a few large channels as a trained model's have; the survivors
    gathered from the packed panels or from the dense rows."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((3001, 64), (1000, 37), (2000, 96)):
        weight, bias = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen) * 0.1
        for b in (None, bias):
            head = _head(weight, b, dense, screen=screen)
            for m in (1, 7, 8, 9, 40):
                x = torch.randn(m, k, generator=gen)
                x[:, 3] *= 20.0
                _screened(head, x)


def test_a_pair_ranked_the_other_way_in_bf16() -> None:
    """Column 700 has the larger fp32 logit, column 300 the larger bf16 score: the bf16 head's own
    argmax takes 300, the screen must still give 700 (it fails with a bound below bf16's rounding)."""
    assert KERNELS is not None
    k = 32
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(1024, k, generator=gen) * 0.01
    weight[300], weight[700] = _flipped_pair(k)
    x = torch.zeros(3, k)
    x[:, 0] = x[:, 1] = 1.0
    assert PackedWeight(weight, None, "native_bf16", KERNELS).argmax(x).tolist() == [300] * 3  # type: ignore[union-attr]
    assert _screened(_head(weight), x).tolist() == [700] * 3


@pytest.mark.parametrize("screen", FP32_SCREENS)
def test_ties_take_the_first_column(screen: str) -> None:
    """Equal weight rows give equal fp32 logits: the first of them wins, whichever panel or lane
    each sits in, and a row can tie in columns that other rows do not keep."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(500, 16, generator=gen) * 0.01
    top = torch.full((16,), 0.5)
    for col in (451, 130, 47, 48):
        weight[col] = top
    x = torch.ones(2, 16)
    x[1] = -1.0
    tokens = _screened(_head(weight, screen=screen), x)
    assert tokens[0].item() == 47
    assert tokens[1].item() != 47


@pytest.mark.parametrize("screen", FP32_SCREENS)
def test_non_finite_rows_and_overflow_take_the_full_head(screen: str) -> None:
    """A NaN or inf in x, or scores past fp32's range, hand the call to the full head: the tokens are
    still numpy's over the full logits (a NaN logit counts as the maximum)."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 16, generator=gen)
    weight[7, 5] = 4.0  # 3e38 times it is past fp32's range
    head = _head(weight, screen=screen)
    assert head.screen is not None
    packed = head.packed
    assert isinstance(packed, torch.Tensor)
    for poison in (float("nan"), float("inf"), 3e38):
        x = torch.randn(3, 16, generator=gen)
        x[1, 5] = poison
        out = torch.full((3,), -1, dtype=torch.int64)
        assert not head.screen.argmax(x, packed, None, torch.empty(3 * 48), 48, out)
        assert torch.equal(head.argmax(x), greedy_tokens(head(x)))  # type: ignore[arg-type]


@pytest.mark.parametrize("screen", FP32_SCREENS)
def test_a_flat_row_takes_the_full_head(screen: str) -> None:
    """Every column's logit equal: all of them survive, more than the screen computes (a quarter of
    the vocabulary), so the full head runs and gives column 0."""
    weight = torch.full((960, 8), 0.25)
    head = _head(weight, screen=screen)
    assert head.screen is not None and head.screen.cap == 960 // 4
    packed = head.packed
    assert isinstance(packed, torch.Tensor)
    x = torch.ones(2, 8)
    out = torch.full((2,), -1, dtype=torch.int64)
    assert not head.screen.argmax(x, packed, None, torch.empty(2 * 96), 96, out)
    assert head.argmax(x).tolist() == [0, 0]  # type: ignore[union-attr]


def test_refuses_non_finite_weights() -> None:
    assert KERNELS is not None
    weight = torch.zeros(96, 8)
    weight[5, 1] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        HeadScreen(weight, KERNELS)
    for mode in ("native", "native_bf16"):
        with pytest.raises(ValueError, match="finite"):
            HeadScreenInt8(weight, KERNELS, mode)


@BF16
@pytest.mark.parametrize("dense", [False, True])
def test_bf16_tokens_are_the_bf16_heads(dense: bool) -> None:
    """bf16 mode's head, scored in int8 groups of 32: as the fp32 case, with a k that is no
    multiple of the group (37: the codes padded) and one of several groups (96)."""
    gen = torch.Generator().manual_seed(4)
    for n, k in ((3001, 96), (1000, 37)):
        weight, bias = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen) * 0.1
        for b in (None, bias):
            head = _head(weight, b, dense, "native_bf16", "int8")
            for m in (1, 5, 9, 40):
                x = torch.randn(m, k, generator=gen)
                x[:, 3] *= 20.0
                _screened(head, x)


@pytest.mark.parametrize("mode", [pytest.param("native_bf16", marks=BF16), pytest.param("native", marks=INT8)])
def test_a_pair_ranked_the_other_way_in_int8(mode: str) -> None:
    """One group of 32, x = (1, 1, 0, ...) and a weight of 127/128 where x is 0 (the group's step
    2^-7 for both columns): column 100 = (17, 17) x 2^-12, codes (1, 1), scores 2^-6 but logit
    0.0083; column 900 = (47 x 2^-12, 0), codes (1, 0), score 2^-7 but logit 0.0115. int8 takes 100,
    the screen must still give 900 (it fails with a bound cut below the codes' rounding). The
    weights are bf16 values, so bf16 mode's logits and fp32 mode's order the pair alike."""
    assert KERNELS is not None
    k = 32
    weight = torch.randn(1024, k, generator=torch.Generator().manual_seed(5)) * 1e-4
    weight[100, :2] = 17 * 2.0**-12
    weight[900, 0], weight[900, 1] = 47 * 2.0**-12, 0.0
    weight[100, 2] = weight[900, 2] = 127 / 128
    x = torch.zeros(2, k)
    x[:, 0] = x[:, 1] = 1.0
    codes, step = pack_screen_int8(weight, KERNELS.panel_width, KERNELS.screen_group)[:2]
    w_hat = codes.transpose(1, 2).reshape(-1, k).double() * step.transpose(1, 2).reshape(-1, 1).double()
    scores = x.double() @ w_hat[:1024].T
    assert int(scores[0].argmax()) == 100  # the int8 scores' order
    assert _screened(_head(weight, mode=mode, screen="int8"), x).tolist() == [900, 900]


@BF16
def test_bf16_non_finite_and_flat_rows_take_the_full_head() -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(960, 32, generator=gen)
    head = _head(weight, mode="native_bf16", screen="int8")
    flat = _head(torch.full((960, 32), 0.25), mode="native_bf16", screen="int8")
    for h, x in ((head, torch.full((2, 32), float("nan"))), (head, torch.full((2, 32), float("inf"))),
                 (flat, torch.ones(2, 32))):  # fmt: skip
        assert h.screen is not None
        packed = h.packed
        assert isinstance(packed, torch.Tensor)
        out = torch.full((2,), -1, dtype=torch.int64)
        assert not h.screen.argmax(x, packed, None, torch.empty(2 * 96), 96, out)
        assert torch.equal(h.argmax(x), greedy_tokens(h(x)))  # type: ignore[arg-type]
