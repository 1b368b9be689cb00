"""The ``triton`` attention backend: the :class:`AttentionBackend` protocol on Triton kernels.

The CUDA default. On the CPU it runs only under ``TRITON_INTERPRET=1`` (slowly; the tests do this
on tiny shapes), so the CPU default stays the torch backend.
"""

from __future__ import annotations

import torch

from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.kernels import paged_attention, write_kv
from services.model_runner.native import NativeKernels


class TritonAttentionBackend:
    """Launches ``write_kv`` and the unified ``paged_attention`` kernel; holds no state."""

    name: str = "triton"
    native_kernels: NativeKernels | None = None

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Stores K/V at their slots (divided by the scale when the cache is fp8)."""
        write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
        """Causal varlen attention of each sequence's new tokens over its cached context.

        Output rows of batch padding (past ``meta.query_start_loc[-1]``) are left unwritten.
        """
        return paged_attention(
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            softmax_scale,
            k_scale,
            v_scale,
            window=meta.window,
        )
