"""The Triton ``write_kv`` kernel against its torch twin (CPU, ``TRITON_INTERPRET=1``, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from services.model_runner.attention.kernels.write_kv import FP8_E4M3_MAX, write_kv, write_kv_ref

FP8 = torch.float8_e4m3fn


def _random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K and a V cache full of random values, so a skipped or misplaced write shows."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def _random_slots(num_tokens: int, num_blocks: int, block_size: int, num_pad: int) -> torch.Tensor:
    """Distinct slots outside the null block 0, with ``num_pad`` of them replaced by -1."""
    slots = torch.randperm((num_blocks - 1) * block_size)[:num_tokens] + block_size
    slots[torch.randperm(num_tokens)[:num_pad]] = -1
    return slots.long()


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality (fp8 tensors compared through their bytes: torch has no fp8 ==)."""
    assert a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "scale"),
    [
        (torch.float32, torch.float32, 1.0),
        (torch.float16, torch.float16, 1.0),
        (torch.bfloat16, torch.bfloat16, 1.0),
        (torch.float32, torch.float16, 1.0),
        (torch.float32, FP8, 0.05),
        (torch.bfloat16, FP8, 0.02),
    ],
    ids=["fp32", "fp16", "bf16", "fp32->fp16", "fp32->fp8", "bf16->fp8"],
)
def test_matches_reference(
    block_size: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, scale: float
) -> None:
    torch.manual_seed(0)
    num_tokens, num_kv_heads, num_blocks = 11, 3, 8
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    k_cache, v_cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = _random_slots(num_tokens, num_blocks, block_size, num_pad=3)

    write_kv(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=2 * scale)
    write_kv_ref(key, value, k_expected, v_expected, slots, k_scale=scale, v_scale=2 * scale)

    _assert_same(k_cache, k_expected)
    _assert_same(v_cache, v_expected)


def test_padding_rows_leave_the_cache_untouched() -> None:
    torch.manual_seed(1)
    k_cache, v_cache = _random_cache(4, 4, 2, 16, torch.float32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 2, 16)
    write_kv(key, key, k_cache, v_cache, torch.tensor([-1, 9, -1]))
    changed = (k_cache != before_k).any(-1).any(-1).flatten()  # [num_slots]
    assert changed.nonzero().flatten().tolist() == [9]
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[9], key[1], rtol=0, atol=0)
    assert torch.equal((v_cache != before_v).any(-1).any(-1).flatten(), changed)


def test_strided_views_of_a_fused_qkv() -> None:
    """K/V sliced out of a fused QKV projection are written without a copy."""
    torch.manual_seed(2)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    k_cache, v_cache = _random_cache(4, 8, num_kv_heads, head_dim, torch.float32)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = _random_slots(num_tokens, 4, 8, num_pad=1)

    write_kv(key, value, k_cache, v_cache, slots)
    write_kv_ref(key, value, k_expected, v_expected, slots)

    _assert_same(k_cache, k_expected)
    _assert_same(v_cache, v_expected)


def test_fp8_rounds_and_saturates_like_torch() -> None:
    """Values over the whole e4m3 range (subnormals, ties, overflow) quantise exactly as torch does."""
    torch.manual_seed(3)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()  # [253] every finite e4m3 value
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: must round to the even neighbour
    values = torch.cat(
        [
            grid,
            midpoints,
            torch.randn(512) * 10 ** torch.empty(512).uniform_(-4, 3),
            torch.tensor([0.0, -0.0, 448.0, 463.9, 464.0, 1e6, -1e6, 2.0**-10, -(2.0**-10)]),
        ]
    )
    head_dim = 16
    values = torch.nn.functional.pad(values, (0, -values.numel() % head_dim)).view(-1, 1, head_dim)
    num_tokens = values.shape[0]
    k_cache = torch.zeros(num_tokens, 1, 1, head_dim).to(FP8)  # block size 1: one slot per block
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(num_tokens)

    write_kv(values, -values, k_cache, v_cache, slots)

    expected = values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8).view(num_tokens, 1, 1, head_dim)
    _assert_same(k_cache, expected)
    _assert_same(v_cache, (-values).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8).view_as(expected))


def test_empty_batch_is_a_no_op() -> None:
    k_cache, v_cache = _random_cache(2, 4, 1, 16, torch.float32)
    before = k_cache.clone()
    empty = torch.empty(0, 1, 16)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.long))
    assert torch.equal(k_cache, before)


def test_rejects_mismatched_shapes() -> None:
    k_cache, v_cache = _random_cache(2, 4, 2, 16, torch.float32)
    key = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="slots"):
        write_kv(key, key, k_cache, v_cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="k_cache"):
        write_kv(key, key, k_cache[:, :, :1], v_cache[:, :, :1], torch.zeros(3, dtype=torch.long))
