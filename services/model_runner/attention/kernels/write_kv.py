"""Triton kernel that stores a step's new K/V rows into their paged-cache slots.

One program per token writes all of that token's kv heads (``num_kv_heads * head_dim`` values of K
and of V) to ``slot = block_id * block_size + offset``; slot ``-1`` marks a padding row and is
skipped, so the cache keeps whatever it held there.

For an fp8 cache (``torch.float8_e4m3fn``) the stored value is ``value / scale``, computed in fp32,
saturated to the e4m3 range (+-448) and rounded to nearest even; other caches store the value as is
(converted to the cache dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn


@triton.jit
def _round_to_e4m3(x):  # type: ignore[no-untyped-def]
    """Saturates fp32 ``x`` to +-448 and rounds it onto the e4m3 grid (nearest even), in fp32.

    NOTE: the GPU's fp32 -> fp8 conversion does this by itself; doing it here first makes the
    conversion exact, which is what lets the CPU interpreter (whose fp32 -> fp8 cast drops the carry
    of a rounding that crosses a power of two) agree with ``torch``. It is a handful of integer ops
    in a memory-bound kernel.
    """
    magnitude = tl.minimum(tl.abs(x), 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) - 127, -6)  # e4m3 subnormals share the smallest normal's spacing
    # The spacing of e4m3 values near x (3 mantissa bits) and its inverse, as exact powers of two.
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    # Adding then subtracting 1.5 * 2**23 rounds to the nearest integer (ties to even).
    magnitude = ((magnitude * inv_ulp + 12582912.0) - 12582912.0) * ulp
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 stays -0.0
    return tl.where(negative, -magnitude, magnitude)


@triton.jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    k_scale,  # fp32 scalar, used only when IS_FP8
    v_scale,  # fp32 scalar, used only when IS_FP8
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per block)
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    if IS_FP8:
        # NOTE: div_rn, IEEE division like torch's (plain `/` may be approximate on the GPU).
        k = _round_to_e4m3(tl.div_rn(k.to(tl.float32), k_scale))
        v = _round_to_e4m3(tl.div_rn(v.to(tl.float32), v_scale))
    k_dst = (
        k_cache_ptr
        + block * stride_kcb
        + in_block * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcb
        + in_block * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores each token's K/V at its slot, in place; rows with slot -1 are skipped.

    Any strides work (e.g. K/V as views into a fused QKV projection), so no copy is needed.

    Raises:
        ValueError: on mismatched shapes or an fp8 cache for only one of K/V.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, slots {tuple(slot_mapping.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} for key {tuple(key.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch twin of :func:`write_kv` (the tests' reference)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, num_kv_heads, head_dim]
        rows = src[keep]
        if cache.dtype == torch.float8_e4m3fn:
            # NOTE: indexed writes lack fp8 kernels on some devices; the raw bytes are the same thing.
            fp8 = (rows.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache.dtype)
            flat.view(torch.uint8)[slots] = fp8.view(torch.uint8)
        else:
            flat[slots] = rows.to(cache.dtype)
