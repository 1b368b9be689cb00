"""The attention-backend contract shared by the torch reference and the Triton kernels.

KV pool layout (one tensor per runner)::

    pool: [layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim]
             │               │      │          │
             │               │      │          └─ token offset inside the block
             │               │      └─ block id (0 = null block, never holds real tokens)
             │               └─ 0 = K, 1 = V
             └─ the layer's slot in its KV cache group (``ModelConfig.kv_groups``)

    slot = block_id * block_size + offset      (slot -1 = padding: skip the write)

A step's tokens are flattened into one varlen batch: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and attends to its first ``seq_lens[i]`` cached tokens
(the new tokens included, written into the cache before attention), causally. Each KV cache group
has metadata of its own (its block tables and slots; the query ranges and lengths are shared); a
window group's ``window`` limits each query at position ``p`` to keys ``p - window < j <= p``
(transformers' ``sliding_window_overlay``). Its block tables may hold the null block or blocks
since reused by another request at positions before a query's window, so a backend must never
read K/V there: not just mask them, skip them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from services.model_runner.native import NativeKernels

T = TypeVar("T")


@dataclass(frozen=True)
class AttentionMetadata:
    """Flat batch description of one step (built by ``services.model_runner.input_batch``).

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the cache slot each new token's K/V goes to.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths (cu_seqlens_q).
        seq_lens: ``[num_seqs]`` int32, context length of each sequence after this step.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, padded with 0 (the null block).
        max_query_len: longest query in the batch.
        max_seq_len: longest context in the batch.
        window: the sliding window of the layers that use this metadata (their KV cache group);
            None = full attention.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    window: int | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return int(self.seq_lens.shape[0])


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into the paged cache and computes paged attention.

    Attributes:
        name: what ``RunnerConfig.attention_backend`` calls it.
        native_kernels: the native CPU kernels the backend runs on, or None. The runner prepares
            the model for the same kernels (``model/native_layers.py``), so the norms, rotary,
            SwiGLU and GEMMs go native exactly when attention does.
    """

    name: str
    native_kernels: NativeKernels | None

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
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
        """Causal varlen attention of each sequence's new tokens over its cached context."""
        ...


STEP_CACHE = 8  # step metadata remembered per backend: one per KV cache group of the current step


class MetaCache(Generic[T]):
    """What a step's metadata derives to, per metadata object (one per KV cache group), built once.

    A step's metadata is never mutated, so identity is the key; the last :data:`STEP_CACHE`
    entries are kept, enough for every group of a step (layers of different groups interleave).
    """

    def __init__(self) -> None:
        self._entries: list[tuple[object, T]] = []

    def get(self, key: object, build: Callable[[], T]) -> T:
        for seen, value in self._entries:
            if seen is key:
                return value
        value = build()
        self._entries.append((key, value))
        if len(self._entries) > STEP_CACHE:
            self._entries.pop(0)
        return value
