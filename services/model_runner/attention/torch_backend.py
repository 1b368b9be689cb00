"""Paged attention in plain torch: the reference for the Triton kernels and the CPU default.

``write_kv`` scatters each new token's K/V into its slot; ``forward`` gathers every sequence's
context back from its block table and runs ``scaled_dot_product_attention``. Decodes (one query
row) are batched into a single padded call, the common case of a busy server; sequences with
several query rows (prefill chunks) run one call each, with the causal mask shifted so that query
``i`` of a chunk at position ``p`` sees keys ``0..p``::

    keys:      0 1 2 3 4 5 6        (seq_len 7, the last 3 are this chunk's own tokens)
    query 0:   x x x x x . .        position 4
    query 1:   x x x x x x .        position 5
    query 2:   x x x x x x x        position 6

fp8 caches (``torch.float8_e4m3fn``) store ``x / scale`` saturated at +-448 and read back
``cache * scale`` in the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model_runner.attention.base import AttentionMetadata

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class TorchAttentionBackend:
    """The :class:`~services.model_runner.attention.base.AttentionBackend` of plain torch ops."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,  # [T, KV, D]
        value: torch.Tensor,  # [T, KV, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Stores K/V at their slots; rows whose slot is -1 (padding) are not written."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]  # [T']
        _store(k_cache, key[keep], slots, k_scale)
        _store(v_cache, value[keep], slots, v_scale)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each sequence's query rows over its first ``seq_lens[i]`` cached keys."""
        out = torch.empty_like(query)
        starts: list[int] = meta.query_start_loc.tolist()
        seq_lens: list[int] = meta.seq_lens.tolist()
        decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], device=query.device)
            seqs = torch.tensor(decodes, device=query.device)
            max_len = max(seq_lens[i] for i in decodes)
            out[rows] = self._decode(
                query[rows], k_cache, v_cache, meta.block_tables[seqs], meta.seq_lens[seqs], max_len,
                softmax_scale, k_scale, v_scale,
            )  # fmt: skip
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start <= 1:
                continue  # a decode (done above) or a sequence with nothing scheduled
            block_table = meta.block_tables[i]
            k = _gather(k_cache, block_table[None], seq_len, query.dtype, k_scale)[0]  # [S, KV, D]
            v = _gather(v_cache, block_table[None], seq_len, query.dtype, v_scale)[0]  # [S, KV, D]
            out[start:end] = _causal_chunk(query[start:end], k, v, softmax_scale)
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        max_len: int,
        softmax_scale: float,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:  # [B, H, D]
        """One padded SDPA call for every single-row query; keys past each ``seq_len`` masked out."""
        k = _gather(k_cache, block_tables, max_len, query.dtype, k_scale)  # [B, S, KV, D]
        v = _gather(v_cache, block_tables, max_len, query.dtype, v_scale)  # [B, S, KV, D]
        valid = torch.arange(k.shape[1], device=query.device)[None, :] < seq_lens[:, None]  # [B, S]
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [B, H, 1, D]
            k.transpose(1, 2),  # [B, KV, S, D]
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],  # [B, 1, 1, S]
            scale=softmax_scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return o.squeeze(2)


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``q`` ``[Q, H, D]`` are the last ``Q`` positions of ``k``/``v`` ``[S, KV, D]``; returns ``[Q, H, D]``."""
    num_q, seq_len = q.shape[0], k.shape[0]
    mask = None
    if num_q != seq_len:
        # NOTE: SDPA's is_causal aligns the mask top-left; a chunk after cached context needs it
        # bottom-right: query i sits at position seq_len - num_q + i.
        query_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)  # [Q]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [Q, S]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Q, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, KV, S, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=softmax_scale,
        enable_gqa=True,
    )  # [1, H, Q, D]
    return o[0].transpose(0, 1)


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    length: int,
    dtype: torch.dtype,
    scale: float,
) -> torch.Tensor:  # [B, length, KV, D]
    """The first ``length`` cached tokens of each block table, dequantized to ``dtype``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [B, nb, block_size, KV, D]
    tokens = blocks.flatten(1, 2)[:, :length]  # [B, length, KV, D]
    if cache.dtype == FP8_DTYPE:
        return tokens.to(dtype) * scale
    return tokens.to(dtype)


def _store(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """``cache`` viewed as ``[num_slots, KV, D]``; ``x`` ``[T', KV, D]`` goes to rows ``slots``."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, KV, D]
    if cache.dtype == FP8_DTYPE:
        # NOTE: index_copy_ has no fp8 kernel on CPU; copying the raw bytes is the same thing.
        quantized = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        flat.view(torch.uint8).index_copy_(0, slots, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))
