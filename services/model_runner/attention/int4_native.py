"""The ``cpu`` backend's INT4 path: ``native/int4_kv.c`` writes and reads the packed cache in place.

Kept apart from ``cpu_backend.py`` so that its fp32 paths read as before; the backend calls these
two functions for a ``uint8`` (INT4) cache and falls back to the torch reference when they return
False / None (kernels not built, a layout they do not take).
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.model_runner.native import NativeKernels, is_cpu_fp32


class RowPlan(Protocol):
    """What :func:`forward` reads of ``cpu_backend.NativeDecodePlan`` (one entry per query row)."""

    @property
    def rows(self) -> torch.Tensor: ...  # [n] int32

    @property
    def seq_lens(self) -> torch.Tensor: ...  # [n] int32, keys each row sees

    @property
    def tables(self) -> torch.Tensor: ...  # [n, W] int32

    @property
    def max_len(self) -> int: ...


def rows_contiguous(x: torch.Tensor) -> bool:
    """``x`` ``[T, heads, D]`` has each row's ``heads * D`` values contiguous (any row stride)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(
    kernels: NativeKernels | None,
    key: torch.Tensor,  # [T, KV, D] fp32
    value: torch.Tensor,  # [T, KV, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, row_bytes] uint8
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> bool:
    """Quantizes and stores K/V at their slots natively; False (nothing written) when it cannot."""
    if (kernels is None or kernels.write_kv_int4 is None or not (is_cpu_fp32(key) and is_cpu_fp32(value))
            or not (rows_contiguous(key) and rows_contiguous(value)) or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.device.type != "cpu" or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()):  # fmt: skip
        return False
    kernels.write_kv_int4(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2], k_cache.shape[0] * k_cache.shape[1],
    )  # fmt: skip
    return True


def forward(
    kernels: NativeKernels,
    plan: RowPlan,
    query: torch.Tensor,  # [T, H, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, row_bytes] uint8
    v_cache: torch.Tensor,
    softmax_scale: float,
    window: int = 0,
) -> torch.Tensor | None:  # [T, H, D]; None: not taken (the caller uses the torch reference)
    """Causal attention of every query row over the INT4 cache, each row as the decode of its position.

    Rows outside the plan (batch padding) are zero. ``window`` > 0: a sliding-window layer's rows see
    only their last ``window`` keys (``AttentionMetadata.window``'s rule).

    Raises:
        RuntimeError: the kernel could not allocate its buffers.
    """
    if (kernels.paged_attention_int4 is None or not is_cpu_fp32(query) or k_cache.device.type != "cpu"
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):  # fmt: skip
        return None
    if not rows_contiguous(query):
        query = query.contiguous()
    out = torch.zeros(query.shape, dtype=query.dtype)
    n = plan.rows.shape[0]
    if n == 0:
        return out
    status = kernels.paged_attention_int4(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        plan.tables.data_ptr(), plan.tables.stride(0), plan.seq_lens.data_ptr(), plan.rows.data_ptr(), n,
        out.data_ptr(), out.stride(0), query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1],
        plan.max_len, softmax_scale, window,
    )  # fmt: skip
    if status == -1:
        return None
    if status != 0:
        raise RuntimeError(f"native INT4 paged attention failed with status {status}")
    return out
