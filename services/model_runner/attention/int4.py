"""INT4 KV cache format: the torch reference of its quantization, and the optional Hadamard rotation.

One (token, KV head) row of K or V is ``head_dim`` values; it is stored as
``shared.kv_layout.int4_row_bytes(head_dim)`` bytes in the pool's last dimension (the pool is a
``uint8`` tensor ``[layers, 2, num_blocks, block_size, kv_heads, row_bytes]``), so a block id's bytes
carry their own scales and the offload-store and block copies move them as any other page::

    row (head_dim 64, group 32):   [ 32 bytes: nibbles of x0..x63 | 2 x float16 scale (group 0, 1) ]
    byte j of the nibbles:         low nibble = x[2j], high nibble = x[2j + 1]
    nibble = q + 8,   q = round_half_even(clamp(x / scale, -7, 7))  in -7..7
    scale  = float16(amax(|x| over the group) / 7)      (0 for an all-zero group: every q is 0)

Symmetric (no zero point): K and V rows are centred near zero, and a zero point would cost 2 more
bytes per group. The division is IEEE fp32 by the float16 scale widened to fp32, and the clamp
comes before the rounding, so the native and Triton writes can produce these exact bytes (the tests
compare them bit for bit). Dequantization ``(nibble - 8) * scale`` is exact in fp32.

**Hadamard rotation** (optional, ``RunnerConfig.kv_cache_hadamard``): before quantizing, each group
of ``G`` channels of K and V is multiplied by the normalized Sylvester Hadamard matrix ``H`` (``G x
G``, ``H = H^T``, ``H H = I``), which spreads an outlier channel over the group so that one large
value no longer sets a coarse scale for the rest. Attention stays exact in exact arithmetic:
``(qH)(kH)^T = q k^T``, and the output ``softmax(.) (VH) = (softmax(.) V) H`` is rotated back by
``H`` once more. The model applies it around the backend (``model/layers.py``), so the kernels only
ever see a plain INT4 cache.
"""

from __future__ import annotations

import functools

import torch

from shared.kv_layout import INT4_SCALE_BYTES, int4_group_size, int4_row_bytes

INT4_DTYPE = torch.uint8  # the pool's element type for an INT4 cache
INT4_QMAX = 7.0
FP16_MAX = 65504.0

__all__ = ["INT4_DTYPE", "dequantize_int4", "hadamard", "int4_head_dim", "quantize_int4", "rotate_groups"]


def int4_head_dim(row_bytes: int) -> int:
    """The ``head_dim`` whose INT4 rows take ``row_bytes`` (the inverse of ``int4_row_bytes``).

    Raises:
        ValueError: no head_dim gives rows of that size.
    """
    # Rows grow strictly with head_dim (9/16 bytes a channel from 32 on, d/2 + 2 below), so the
    # inverse is unique; the two formulas meet at head_dim 32 (18 bytes).
    head_dim = 2 * (row_bytes - INT4_SCALE_BYTES) if row_bytes <= 18 else row_bytes * 16 // 9
    try:
        if head_dim > 0 and int4_row_bytes(head_dim) == row_bytes:
            return head_dim
    except ValueError:
        pass
    raise ValueError(f"{row_bytes} bytes is no INT4 row size")


def quantize_int4(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) -> its packed rows ``[..., int4_row_bytes]`` uint8."""
    head_dim = x.shape[-1]
    group = int4_group_size(head_dim)
    g = x.float().reshape(*x.shape[:-1], head_dim // group, group)  # [..., n_groups, G]
    scale = (g.abs().amax(-1) / INT4_QMAX).clamp(max=FP16_MAX).to(torch.float16)  # [..., n_groups]
    wide = scale.float().unsqueeze(-1)
    q = torch.where(wide > 0, g / wide, torch.zeros_like(g)).clamp(-INT4_QMAX, INT4_QMAX).round()
    nibbles = (q + 8).to(torch.uint8).reshape(*x.shape[:-1], head_dim)
    data = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [..., head_dim / 2]
    return torch.cat((data, scale.contiguous().view(torch.uint8)), dim=-1)


def dequantize_int4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[..., row_bytes]`` uint8 -> ``[..., head_dim]`` in ``dtype`` (exact in fp32)."""
    head_dim = int4_head_dim(packed.shape[-1])
    group = int4_group_size(head_dim)
    data = packed[..., : head_dim // 2]
    nibbles = torch.stack((data & 15, data >> 4), dim=-1).reshape(*packed.shape[:-1], head_dim // group, group)
    scale = packed[..., head_dim // 2 :].contiguous().view(torch.float16).float()  # [..., n_groups]
    x = (nibbles.float() - 8.0) * scale.unsqueeze(-1)
    return x.reshape(*packed.shape[:-1], head_dim).to(dtype)


@functools.cache
def _hadamard_cpu(size: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / size**0.5


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized ``size x size`` Sylvester Hadamard matrix in fp32 (symmetric, orthonormal).

    Raises:
        ValueError: ``size`` not a power of two.
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {size}")
    return _hadamard_cpu(size).to(device)


def rotate_groups(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` with each group of ``h.shape[0]`` channels multiplied by ``h``
    (block-diagonal rotation), in ``x``'s dtype; computed in fp32."""
    group = h.shape[0]
    shape = x.shape
    rotated = x.float().reshape(*shape[:-1], shape[-1] // group, group) @ h
    return rotated.reshape(shape).to(x.dtype)
