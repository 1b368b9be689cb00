"""Triton kernels of the INT4 KV cache: the slot writes, and the packed-row loads of ``paged_attention``.

The format is ``attention/int4.py``'s (the torch reference): per (token, KV head) row,
``head_dim / 2`` bytes of nibbles (low = even channel), then one float16 scale per group of
``G`` channels. The cache is passed twice, as its ``uint8`` bytes and as the same storage viewed as
``float16`` (for the scales; rows have an even number of bytes, so every scale is 2-byte aligned
and its fp16 index is its byte offset / 2).

The write is one program per (token, KV head, group): the group's even and odd channels are loaded
as two vectors, so that a nibble pair packs into one byte without a reshape. It computes the scale
and the nibbles exactly as the reference does (fp32 amax / 7, rounded to float16; IEEE division by
the widened scale; clamp to +-7, then round half to even), so the bytes match it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.model_runner.attention.int4 import int4_head_dim
from shared.kv_layout import int4_group_size

ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to the nearest integer, ties to even


@triton.jit
def _write_kv_int4_kernel(  # type: ignore[no-untyped-def]
    src_ptr,  # [num_tokens, num_kv_heads, head_dim] K or V
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, row_bytes] uint8
    scale_ptr,  # the same storage as float16
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_t,
    stride_h,
    stride_d,
    stride_cb,  # cache strides in bytes
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    half = tl.arange(0, GROUP // 2)
    channel = group * GROUP + 2 * half  # [G/2] even channels of the group
    src = src_ptr + token * stride_t + head * stride_h
    even = tl.load(src + channel * stride_d).to(tl.float32)
    odd = tl.load(src + (channel + 1) * stride_d).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(even), 0), tl.max(tl.abs(odd), 0))
    scale = tl.minimum(tl.div_rn(amax, 7.0), 65504.0).to(tl.float16)
    wide = scale.to(tl.float32)
    safe = tl.where(wide > 0.0, wide, 1.0)
    qe = tl.where(wide > 0.0, tl.div_rn(even, safe), 0.0)
    qo = tl.where(wide > 0.0, tl.div_rn(odd, safe), 0.0)
    qe = (tl.minimum(tl.maximum(qe, -7.0), 7.0) + ROUND_MAGIC) - ROUND_MAGIC
    qo = (tl.minimum(tl.maximum(qo, -7.0), 7.0) + ROUND_MAGIC) - ROUND_MAGIC
    byte = (qe.to(tl.int32) + 8) | ((qo.to(tl.int32) + 8) << 4)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch  # bytes
    tl.store(cache_ptr + row + group * (GROUP // 2) + half, byte.to(tl.uint8))
    tl.store(scale_ptr + row // 2 + HEAD_DIM // 4 + group, scale)


@triton.jit
def load_int4(  # type: ignore[no-untyped-def]
    cache_ptr,  # uint8 bytes of the cache
    scale_ptr,  # the same storage as float16
    row,  # byte offsets of the rows to load (any shape S)
    offs_d,  # channel indices (shape broadcastable against row)
    mask,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Dequantized fp32 values ``(nibble - 8) * scale`` of channels ``offs_d`` of the rows at ``row``."""
    byte = tl.load(cache_ptr + row + offs_d // 2, mask=mask, other=8).to(tl.int32)
    nibble = (byte >> ((offs_d % 2) * 4)) & 15
    scale = tl.load(scale_ptr + row // 2 + HEAD_DIM // 4 + offs_d // GROUP, mask=mask, other=0.0)
    return (nibble - 8).to(tl.float32) * scale.to(tl.float32)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """The INT4 cache's storage as float16 (where the kernels read and write the scales)."""
    return cache.view(torch.float16)


def int4_layout(cache: torch.Tensor) -> tuple[int, int]:
    """``(head_dim, group)`` of an INT4 cache ``[num_blocks, block_size, KV, row_bytes]``.

    Raises:
        ValueError: not a contiguous-row uint8 cache of an INT4 row size, or a head_dim not a
            multiple of 4 (odd scale offsets).
    """
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.stride(3) != 1:
        raise ValueError(f"an INT4 cache is uint8 [blocks, block_size, kv_heads, row_bytes], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    head_dim = int4_head_dim(cache.shape[3])
    if head_dim % 4 or any(s % 2 for s in cache.stride()[:3]):
        raise ValueError(f"the Triton INT4 kernels need head_dim % 4 == 0 and even strides, got {head_dim}")
    return head_dim, int4_group_size(head_dim)


def write_kv_int4(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_bytes] uint8
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Quantizes each token's K/V rows into their slots (``quantize_int4``'s bytes); -1 is skipped.

    Raises:
        ValueError: mismatched shapes.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,) or k_cache.shape != v_cache.shape:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, cache {tuple(k_cache.shape)}")
    cache_dim, group = int4_layout(k_cache)
    if cache_dim != head_dim or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold rows of key {tuple(key.shape)}")
    if num_tokens == 0:
        return
    grid = (num_tokens, num_kv_heads, head_dim // group)
    for src, cache in ((key, k_cache), (value, v_cache)):
        _write_kv_int4_kernel[grid](
            src, cache, scale_view(cache), slot_mapping, *src.stride(), *cache.stride()[:3],
            HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=cache.shape[1],
        )  # fmt: skip
