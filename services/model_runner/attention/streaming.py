"""Attention sinks (StreamingLLM, Xiao et al. 2023): the opt-in mode for endless streams.

A query at text position ``p`` sees the first ``sink_tokens`` tokens and the last ``window``
tokens, itself included, and nothing between::

    visible keys:  j < min(k, p + 1)   and   max(k, p - W + 1) <= j <= p       (k sinks, window W)

Positions are the paper's "positions within the cache rather than those in the original text":
keys are cached *before* rotary, and at each query the visible keys are rotated at their place
among the visible keys, ``0 .. n-1``, and the query at ``n - 1 = min(p, k + W - 1)``. So no
relative distance exceeds ``k + W - 1`` however long the stream (rotary tables of
``max_position_embeddings`` rows suffice when ``k + W <= max_position_embeddings``)::

    k = 2, W = 3, query at p = 9:   text   0 1 . . . . . 7 8 9
                                    cache  0 1           2 3 4      query rotated at 4

This changes outputs once ``p >= k + W`` (it is not a parity mode: docs/kv_layout.md, "Attention
sinks (StreamingLLM)"); before that nothing is dropped and every position is the text position.

Kept apart from the paged backends (torch_backend.py et al.), which stay exactly as they are: the
layer writes its unrotated keys with the backend's ``write_kv`` and hands the attention to
:class:`StreamingAttention`. It reads only the visible keys' slots, which lie in blocks the
kv-cache-manager keeps (the sink blocks and the window's; the middle ones are freed and their
table entries may be 0).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.model_runner.attention.base import AttentionMetadata

# Rows of one gather-and-attend pass are capped so that their gathered K (and V) stay about this
# many bytes: a long prefill chunk would otherwise gather rows x (k + W) keys at once.
ROW_GROUP_BYTES = 64 << 20

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cache_positions(positions: torch.Tensor, sink_tokens: int, window: int) -> torch.Tensor:
    """The rotary position of each query: its place among its visible keys, ``min(p, k + W - 1)``."""
    return positions.clamp(max=sink_tokens + window - 1)


def visible_slots(query_start_loc: list[int], seq_lens: list[int], block_tables: np.ndarray, block_size: int,
                  sink_tokens: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, valid)``, each ``[T, n_max]``: per query row the cache slots of its visible keys in
    cache order (sinks, then the window) and which columns are real (``n_max = min(k + W, longest)``).

    Padding columns point at slot 0 (the null block, never written); they are masked and their
    values zeroed, so what lies there cannot matter.
    """
    k, w = sink_tokens, window
    rows = []
    for i, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        rows.append((i, np.arange(seq_len - q_len, seq_len)))
    seq_of_row = np.concatenate([np.full(len(p), i) for i, p in rows])  # [T]
    p = np.concatenate([p for _, p in rows])  # [T] text positions
    num_sinks = np.minimum(k, p + 1)  # [T]
    window_start = np.maximum(k, p - w + 1)  # [T]
    n = num_sinks + np.maximum(0, p - window_start + 1)  # [T] = min(p, k + W - 1) + 1
    n_max = int(n.max())
    col = np.arange(n_max)[None, :]  # [1, n_max]
    j = np.where(col < num_sinks[:, None], col, window_start[:, None] + col - num_sinks[:, None])  # [T, n_max]
    valid = col < n[:, None]
    j = np.where(valid, j, 0)
    slots = block_tables[seq_of_row[:, None], j // block_size] * block_size + j % block_size
    return np.where(valid, slots, 0), valid


class StreamingAttention:
    """The attention of every layer in attention-sinks mode (see the module docstring).

    NOTE: what it derives from the metadata (the visible slots and mask) is the same for every
    layer of a step: the first layer computes it, the others reuse it (a step's metadata is never
    mutated), as the torch backend does with its plan.

    Args:
        cos, sin: the model's rotary tables (``RotaryEmbedding.cos`` / signed ``.sin``,
            ``[max_position_embeddings, head_dim]``): the keys are rotated with the very rows
            the queries are.
        sink_tokens, window: ``k`` and ``W`` of the rule.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, sink_tokens: int, window: int):
        if sink_tokens + window > cos.shape[0]:
            raise ValueError(f"sink_tokens + window = {sink_tokens + window} exceeds the {cos.shape[0]} rotary "
                             "positions of the model")
        self.cos, self.sin = cos, sin
        self.sink_tokens, self.window = sink_tokens, window
        self._plan: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """:func:`cache_positions` of the step's text positions: what the model rotates queries by."""
        return cache_positions(positions, self.sink_tokens, self.window)

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._plan
        if cached is None or cached[0] is not meta:
            slots, valid = visible_slots(meta.query_start_loc.tolist(), meta.seq_lens.tolist(),
                                         meta.block_tables.cpu().numpy().astype(np.int64), block_size,
                                         self.sink_tokens, self.window)  # fmt: skip
            device = meta.block_tables.device
            cached = (meta, torch.from_numpy(slots).to(device), torch.from_numpy(valid).to(device))
            self._plan = cached
        return cached[1], cached[2]

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D], already rotated at its cache position
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], unrotated keys
        v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        softmax_scale: float,
        rotate: Rotate,
    ) -> torch.Tensor:  # [T, H, D]
        """Each query row over its visible keys, rotated at ``0 .. n-1`` by ``rotate`` (the layer's
        own rotary op, so keys and queries share one formula); softmax in float32, as the reference."""
        slots, valid = self._plan_for(meta, k_cache.shape[1])
        num_tokens, num_heads, head_dim = query.shape
        num_kv = k_cache.shape[2]
        n_max = slots.shape[1]
        cos = self.cos[:n_max, None].to(query.dtype)  # [n_max, 1, D]
        sin = self.sin[:n_max, None].to(query.dtype)
        k_flat = k_cache.view(-1, num_kv, head_dim)  # [slots, KV, D]
        v_flat = v_cache.view(-1, num_kv, head_dim)
        out = torch.empty_like(query)
        step = max(1, ROW_GROUP_BYTES // max(1, n_max * num_kv * head_dim * query.element_size()))
        for start in range(0, num_tokens, step):
            rows = slice(start, min(num_tokens, start + step))
            mask = valid[rows]  # [R, n_max]
            keys = rotate(k_flat[slots[rows]].to(query.dtype), cos, sin)  # [R, n_max, KV, D]
            values = v_flat[slots[rows]].to(query.dtype).masked_fill(~mask[:, :, None, None], 0.0)
            q = query[rows].view(-1, num_kv, num_heads // num_kv, head_dim)  # [R, KV, G, D]
            scores = q @ keys.permute(0, 2, 3, 1) * softmax_scale  # [R, KV, G, n_max]
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
            out[rows] = (probs @ values.transpose(1, 2)).reshape(-1, num_heads, head_dim)  # [R, KV, G, D] -> [R, H, D]
        return out
