"""One Triton kernel for paged attention over a mixed batch of prefill chunks and decodes.

The batch is the flat varlen layout of ``AttentionMetadata``: sequence ``s`` owns query rows
``query_start_loc[s]:query_start_loc[s+1]`` (its new tokens) and ``seq_lens[s]`` cached tokens (its
new ones included, already written). Query row ``i`` of a sequence sits at absolute position
``p = seq_len - query_len + i`` and attends, causally, to keys ``0..p``. A decode is simply a
sequence with one query row, so prefill chunks and decodes share one launch. With a sliding
``window`` (> 0), row ``p`` sees keys ``p - window < j <= p`` only (transformers' rule), and the key
loop starts at the tile's first row's first key: no block before it is read (a window KV cache
group frees those blocks; they may hold another request's data).

Work split (one program per query tile per kv head)::

    grid = (num_tokens // BLOCK_Q + num_seqs, num_kv_heads)

    sequence s owns tile ids  query_start_loc[s] // BLOCK_Q + s  + 0, 1, ...
    (a binary search over query_start_loc finds s; ids past the sequence's last tile exit)

    tile rows (BLOCK_M = BLOCK_Q * HEAD_GROUP), e.g. HEAD_GROUP = 4, 3 query heads per kv head:

        row:    0   1   2   3  |  4   5   6   7  | ...
        token:  t   t   t   t  | t+1 t+1 t+1 t+1 | ...
        head:   h0  h1  h2  -- | h0  h1  h2  --  | ...     (-- = padding row, masked)

All query heads that share a kv head sit in one tile, so each K/V tile is loaded once for the
whole group (GQA). The inner loop walks the sequence's keys ``TILE_N`` at a time up to the tile's
causal limit, gathering each key's block through the block table (so the cache block size need not
match the tile), with an online softmax accumulated in fp32. For an fp8 cache, ``k_scale`` is
folded into the softmax scale and ``v_scale`` into the final normalisation.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernel uses exp2: exp(x) == exp2(x * log2(e))


@triton.jit
def _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    """Binary search for the sequence whose tile ids include ``tile_idx``.

    Sequence ``s``'s first tile id is ``query_start_loc[s] // BLOCK_Q + s``, a non-decreasing
    sequence, so the answer is the last ``s`` whose first id is ``<= tile_idx``.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [num_tokens, num_heads, head_dim], query's dtype
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # fp32: softmax_scale * k_scale * log2(e)
    v_scale,  # fp32
    num_seqs,
    window,  # sliding window in tokens, 0 = full attention
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bts,
    stride_btb,
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_GROUP: tl.constexpr,  # next power of two >= QUERIES_PER_KV
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per block)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    TILE_N: tl.constexpr,  # keys per inner-loop step, power of two >= 16
    DOT_FP32: tl.constexpr,  # True: matmuls in fp32 (IEEE); False: in the query's 16-bit dtype
):
    BLOCK_M: tl.constexpr = BLOCK_Q * HEAD_GROUP
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # an id past this sequence's last tile
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_pos = q_tile * BLOCK_Q + offs_m // HEAD_GROUP  # [BLOCK_M] row's index in the chunk
    head_in_group = offs_m % HEAD_GROUP  # [BLOCK_M]
    head = kv_head * QUERIES_PER_KV + head_in_group  # [BLOCK_M]
    row_mask = (q_pos < q_len) & (head_in_group < QUERIES_PER_KV)  # [BLOCK_M]
    d_mask = offs_d < HEAD_DIM  # [HEAD_DIM_PAD]
    abs_pos = context_len + q_pos  # [BLOCK_M] row's position in the sequence

    token = (q_start + q_pos).to(tl.int64)  # [BLOCK_M]
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # The tile's last row sees keys up to context_len + (last q_pos); never past seq_len. With a
    # window its first row sees keys from context_len + q_tile * BLOCK_Q - window + 1 on.
    num_keys = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    first_key = tl.where(window > 0, tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start_n in range(first_key, num_keys, TILE_N):
        k_pos = start_n + offs_n  # [TILE_N]
        k_mask = k_pos < num_keys  # [TILE_N], never below first_key
        block = tl.load(block_table + (k_pos // BLOCK_SIZE) * stride_btb, mask=k_mask, other=0)
        block = block.to(tl.int64)  # [TILE_N] NOTE: int64, cache offsets can pass 2**31
        in_block = k_pos % BLOCK_SIZE  # [TILE_N]

        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        # NOTE: DOT_FP32 is constexpr, so only the taken branch is compiled.
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") if DOT_FP32 else tl.dot(q, k.to(q.dtype))
        s = s * qk_scale  # [BLOCK_M, TILE_N] fp32, log2 domain
        in_window = (window == 0) | (k_pos[None, :] > abs_pos[:, None] - window)
        visible = (k_pos[None, :] <= abs_pos[:, None]) & k_mask[None, :] & in_window
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a row that has seen no visible key yet keeps max -inf; subtracting 0 instead
        # keeps exp2 at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M] rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=k_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        pv = (
            tl.dot(p, v.to(tl.float32), input_precision="ieee") if DOT_FP32 else tl.dot(p.to(q.dtype), v.to(q.dtype))
        )  # [BLOCK_M, HEAD_DIM_PAD] fp32
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; real rows always see their own key
    out = acc * (v_scale / l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    window: int | None = None,
    block_m: int | None = None,
    tile_n: int = 32,
    dot_fp32: bool | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Causal varlen attention of each sequence's new tokens over its paged context.

    Rows past ``query_start_loc[-1]`` (batch padding) are left unwritten in the output.

    Args:
        max_query_len: longest query in the batch; only picks the tile height (no device sync).
        k_scale, v_scale: dequantisation scales of an fp8 cache (cache value * scale = real value).
        out: optional preallocated output.
        window: sliding window in tokens (a query at ``p`` sees keys ``p - window < j <= p``);
            None = full attention.
        block_m: rows per query tile (query tokens x padded head group); power of two >= 16, raised
            to the head group if smaller. Default: 16, or 64 when a query fills >= 64 rows.
        tile_n: keys per inner-loop step; power of two >= 16, independent of the cache block size.
            32 by default (larger tiles spill registers at head_dim 128 on sm_90).
        dot_fp32: run the matmuls in fp32 (IEEE). Default: for fp32 queries, and for bf16 ones under
            the CPU interpreter (which cannot do bf16 arithmetic); fp16/bf16 otherwise use tensor
            cores with fp32 accumulation.

    Raises:
        ValueError: on inconsistent shapes or tile sizes.
    """
    num_tokens, num_heads, head_dim = query.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}, query {tuple(query.shape)}")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}, block_tables {tuple(block_tables.shape)}"
            f" for {num_seqs} sequences"
        )
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    head_group = triton.next_power_of_2(queries_per_kv)
    if block_m is None:
        block_m = 64 if max_query_len * head_group >= 64 else 16
    block_m = max(block_m, head_group)
    for name, size in (("block_m", block_m), ("tile_n", tile_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {size}")
    if dot_fp32 is None:
        dot_fp32 = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and _interpreting())
    block_q = block_m // head_group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # NOTE: from the sm_90 register reports (--compile-only): 4 warps spill once the fp32
    # accumulator tile reaches 64 x 64 (32 x 64 with fp32 matmuls); 8 warps do not.
    num_warps = 8 if block_m * head_dim_pad * (2 if dot_fp32 else 1) >= 4096 else 4

    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens.contiguous(),
        query_start_loc.contiguous(),
        float(softmax_scale * k_scale * LOG2E),
        float(v_scale),
        num_seqs,
        int(window or 0),
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_GROUP=head_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_FP32=dot_fp32,
        num_warps=num_warps,
    )
    return out


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype; padding rows zero
    """Plain-torch twin of :func:`paged_attention` (the tests' reference): per sequence, gather
    its keys/values through the block table and run dense causal attention in fp32 (with a
    window, masked to keys ``p - window < j <= p``; this reference reads every block)."""
    out = torch.zeros_like(query)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, : math.ceil(seq_len / block_size)].long()
        k = _gather(k_cache, blocks, seq_len) * k_scale  # [seq_len, kv_heads, dim] fp32
        v = _gather(v_cache, blocks, seq_len) * v_scale
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, num_heads, dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale  # [num_heads, q_len, seq_len]
        q_abs = torch.arange(seq_len - q_len, seq_len, device=query.device)
        keys = torch.arange(seq_len, device=query.device)[None, :]
        hidden = keys > q_abs[:, None]  # [q_len, seq_len]
        if window is not None:
            hidden |= keys <= q_abs[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    blocks: torch.Tensor,  # [n] int64 block ids
    length: int,
) -> torch.Tensor:  # [length, num_kv_heads, head_dim] fp32
    """The first ``length`` tokens stored in ``blocks``, in fp32."""
    # NOTE: indexing lacks fp8 kernels on some devices; gathering the raw bytes is the same thing.
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    return raw[blocks].flatten(0, 1)[:length].view(cache.dtype).float()
