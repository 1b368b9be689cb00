"""Paged attention in plain torch: the reference for the Triton kernels and the CPU default.

``write_kv`` scatters each new token's K/V into its slot; ``forward`` gathers every sequence's
context back from its block table and runs ``scaled_dot_product_attention``. Decodes (one query
row), the common case of a busy server, are batched into padded calls over groups of sequences
(see :func:`_make_plan`); sequences with several query rows (prefill chunks) run one call each,
with the causal mask shifted so that query ``i`` of a chunk at position ``p`` sees keys
``0..p``::

    keys:      0 1 2 3 4 5 6        (seq_len 7, the last 3 are this chunk's own tokens)
    query 0:   x x x x x . .        position 4
    query 1:   x x x x x x .        position 5
    query 2:   x x x x x x x        position 6

A window (``AttentionMetadata.window``) narrows both: a sequence's gather starts at the block of
its first visible key (blocks before it are never read: they may be freed and reused), and the
mask also hides the keys of that first block that lie before each query's window.

fp8 caches (``torch.float8_e4m3fn``) store ``x / scale`` saturated at +-448 and read back
``cache * scale`` in the query's dtype. INT4 caches (``uint8``, packed rows with their scales)
store ``quantize_int4(x)`` and read back ``dequantize_int4`` (``attention/int4.py``, the reference
of that format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model_runner.attention.base import AttentionMetadata, MetaCache
from services.model_runner.attention.int4 import INT4_DTYPE, dequantize_int4, quantize_int4
from services.model_runner.native import NativeKernels
from shared.kv_layout import first_visible_key

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
DECODE_GROUP_BYTES = 4 << 20  # gathered K of one decode group (V as much again): stays in the L2/L3 caches
class TorchAttentionBackend:
    """The :class:`~services.model_runner.attention.base.AttentionBackend` of plain torch ops.

    NOTE: what ``forward`` derives from the metadata (host-side lists, decode groups, block ids,
    masks) is the same for every layer of a step, so it is computed by the first layer and reused
    by the others: the backend remembers the last metadata object (a step's metadata is never
    mutated). Gathered K/V go into scratch buffers that live as long as the backend: a fresh
    tensor per layer page-faults its memory in, which cost more than the copy itself at long
    contexts.
    """

    name = "torch"
    native_kernels: NativeKernels | None = None

    def __init__(self, group_bytes: int = DECODE_GROUP_BYTES):
        """
        Args:
            group_bytes: decodes are gathered and attended in groups of sequences whose K (and
                whose V) take about this many bytes, so that SDPA reads them back from the cache
                rather than from memory (measured in docs/model_runner.md, "Why the code is
                shaped so").
        """
        self.group_bytes = group_bytes
        self._plans: MetaCache[_Plan] = MetaCache()
        self._writes: MetaCache[tuple[torch.Tensor | None, torch.Tensor]] = MetaCache()
        self._scratch: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

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
        keep, slots = self._write_rows(slot_mapping)
        if keep is not None:
            key, value = key[keep], value[keep]
        store(k_cache, key, slots, k_scale)
        store(v_cache, value, slots, v_scale)

    def _write_rows(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(rows to keep or None for all, their slots)``; computed once per step and group, like the plan."""
        def build() -> tuple[torch.Tensor | None, torch.Tensor]:
            valid = slot_mapping >= 0
            everything = bool(valid.all())
            return None if everything else valid, slot_mapping if everything else slot_mapping[valid]

        return self._writes.get(slot_mapping, build)

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
        plan = self._plan_for(meta, k_cache)
        out = torch.empty_like(query)
        for group in plan.decodes:
            rows = group.rows if group.rows is not None else slice(group.first, group.first + group.count)
            k = self._gather(k_cache, group.block_ids, group.max_len, query.dtype, k_scale, 0)  # [n, S, KV, D]
            v = self._gather(v_cache, group.block_ids, group.max_len, query.dtype, v_scale, 1)  # [n, S, KV, D]
            out[rows] = F.scaled_dot_product_attention(
                query[rows].unsqueeze(2),  # [n, H, 1, D]
                k.transpose(1, 2),  # [n, KV, S, D]
                v.transpose(1, 2),
                attn_mask=group.mask,  # [n, 1, 1, S], None when every sequence sees all S keys
                scale=softmax_scale,
                enable_gqa=True,
            ).squeeze(2)  # [n, H, D]
        self._attend_chunks(query, k_cache, v_cache, plan.chunks, out, softmax_scale, k_scale, v_scale, meta.window)
        return out

    def _attend_chunks(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunks: list[Chunk],
        out: torch.Tensor,  # [T, H, D], written at each chunk's rows
        softmax_scale: float,
        k_scale: float,
        v_scale: float,
        window: int | None = None,
    ) -> None:
        """The multi-row sequences (prefill chunks), one gather and one SDPA call each."""
        for chunk in chunks:
            k = self._gather(k_cache, chunk.block_ids, chunk.seq_len, query.dtype, k_scale, 0)[0]  # [S, KV, D]
            v = self._gather(v_cache, chunk.block_ids, chunk.seq_len, query.dtype, v_scale, 1)[0]  # [S, KV, D]
            out[chunk.start : chunk.end] = causal_chunk(query[chunk.start : chunk.end], k, v, softmax_scale, window)

    def _plan_for(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> _Plan:
        bytes_per_token = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        return self._plans.get(
            meta, lambda: _make_plan(meta, k_cache.shape[1], max(1, self.group_bytes // bytes_per_token))
        )

    def _gather(
        self,
        cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        block_ids: torch.Tensor,  # [n, nb] int64
        length: int,
        dtype: torch.dtype,
        scale: float,
        slot: int,
    ) -> torch.Tensor:  # [n, length, KV, D]
        """The first ``length`` cached tokens of each row of block ids, dequantized to ``dtype``.

        NOTE: ``index_select`` on dim 0 copies whole blocks (contiguous rows), several times
        faster than advanced indexing, which copies element by element. ``slot`` names one of
        two scratch buffers (K and V are both alive until SDPA has read them); the result is a
        view of it, valid until the next gather into the same slot.
        """
        n, nb = block_ids.shape
        block = cache.shape[1:]
        numel = n * nb * block.numel()
        key = (slot, cache.dtype, cache.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        blocks = buffer[:numel].view(n * nb, *block)
        torch.index_select(cache, 0, block_ids.view(-1), out=blocks)
        tokens = blocks.view(n, nb * block[0], *block[1:])[:, :length]  # [n, length, KV, D]
        if cache.dtype == FP8_DTYPE:
            return tokens.to(dtype) * scale
        if cache.dtype == INT4_DTYPE:
            return dequantize_int4(tokens, dtype)
        return tokens.to(dtype)


@dataclass(frozen=True)
class _DecodeGroup:
    """Single-row sequences attended in one padded SDPA call.

    Attributes:
        rows: their query rows; None when they are the consecutive rows ``first .. first + count``.
        block_ids: ``[n, nb]`` int64, their block tables from each one's first visible block (0
            with full attention), cut to the ``nb`` blocks ``max_len`` needs.
        max_len: the longest context of the group, counted from each one's first visible block.
        mask: ``[n, 1, 1, max_len]`` bool, False past each sequence's length and before its window;
            None if every sequence sees all ``max_len`` keys.
    """

    rows: torch.Tensor | None
    first: int
    count: int
    block_ids: torch.Tensor
    max_len: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Chunk:
    """A sequence with several query rows ``start:end`` over its first ``seq_len`` keys.

    Public because the ``cpu`` backend plans its multi-row sequences with :func:`make_chunks` too.
    With a window, ``block_ids`` start at the block of the first query's first visible key
    (``first_block``) and ``seq_len`` counts keys from there: the window rule is the same in
    these shifted positions, and no block before them is read.
    """

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [1, nb] int64
    first_block: int = 0
    seq: int = 0  # the sequence's index in the step's metadata (its row of block_tables)

    def table_len(self, block_size: int) -> int:
        """The sequence's length in keys counted from its block table's first block, not from
        ``first_block``: the native kernels' ``seq_len`` (they take the whole table row)."""
        return self.seq_len + self.first_block * block_size


@dataclass(frozen=True)
class _Plan:
    """What every layer of one step runs: the decode groups, then one call per multi-row sequence."""

    decodes: list[_DecodeGroup]
    chunks: list[Chunk]


def _make_plan(meta: AttentionMetadata, block_size: int, group_tokens: int) -> _Plan:
    """Groups consecutive decodes while ``longest context * members <= group_tokens``, or while a
    group has fewer than two members.

    NOTE: two at least, because one sequence is too little work for SDPA's threads (a few heads x
    1 query): single-sequence groups were slower per step (docs/model_runner.md, "Why the code
    is shaped so").
    """
    starts: list[int] = meta.query_start_loc.tolist()
    seq_lens: list[int] = meta.seq_lens.tolist()
    device = meta.block_tables.device
    tables = meta.block_tables.long()  # [B, W]
    decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    # per sequence: its first visible key, the block it lies in, and its keys counted from that block
    first_key = [first_visible_key(n - 1, meta.window) for n in seq_lens]
    first_block = [key // block_size for key in first_key]
    local = [n - b * block_size for n, b in zip(seq_lens, first_block, strict=True)]
    groups: list[_DecodeGroup] = []
    i = 0
    while i < len(decodes):
        members, longest = [decodes[i]], local[decodes[i]]
        i += 1
        while i < len(decodes) and (
            len(members) < 2 or max(longest, local[decodes[i]]) * (len(members) + 1) <= group_tokens
        ):
            longest = max(longest, local[decodes[i]])
            members.append(decodes[i])
            i += 1
        rows = [starts[m] for m in members]
        index = torch.tensor(members, device=device)
        nb = -(-longest // block_size)
        mask = None
        skipped = [first_key[m] - first_block[m] * block_size for m in members]  # keys before the window
        if any(local[m] != longest for m in members) or any(skipped):
            keys = torch.arange(longest, device=device)[None, :]
            ends = torch.tensor([local[m] for m in members], device=device)[:, None]
            valid = (keys < ends) & (keys >= torch.tensor(skipped, device=device)[:, None])  # [n, S]
            mask = valid[:, None, None, :]
        if any(first_block[m] for m in members):
            # NOTE: each row from its own first visible block; past its table's width, the null block
            # (never visible: the mask hides it).
            firsts = torch.tensor([first_block[m] for m in members], device=device)[:, None]
            cols = firsts + torch.arange(nb, device=device)  # [n, nb]
            inside = tables[index[:, None], cols.clamp(max=tables.shape[1] - 1)]
            block_ids = torch.where(cols < tables.shape[1], inside, 0).contiguous()
        else:
            block_ids = tables[index, :nb].contiguous()
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        groups.append(_DecodeGroup(
            rows=None if consecutive else torch.tensor(rows, device=device), first=rows[0], count=len(rows),
            block_ids=block_ids, max_len=longest, mask=mask,
        ))  # fmt: skip
    return _Plan(groups, make_chunks(meta, starts, seq_lens, block_size))


def make_chunks(meta: AttentionMetadata, starts: list[int], seq_lens: list[int], block_size: int) -> list[Chunk]:
    """One :class:`Chunk` per sequence with several query rows (``starts``/``seq_lens`` as host lists)."""
    tables = meta.block_tables
    chunks = []
    for i, seq_len in enumerate(seq_lens):
        num_q = starts[i + 1] - starts[i]
        if num_q > 1:
            first = first_visible_key(seq_len - num_q, meta.window) // block_size
            block_ids = tables[i : i + 1, first : -(-seq_len // block_size)].long()
            chunks.append(Chunk(starts[i], starts[i + 1], seq_len - first * block_size, block_ids, first, i))
    return chunks


def causal_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window: int | None = None
) -> torch.Tensor:
    """``q`` ``[Q, H, D]`` are the last ``Q`` positions of ``k``/``v`` ``[S, KV, D]`` (``v`` may be
    ``[S, KV, Dv]``, as in MLA); returns ``[Q, H, Dv]``."""
    num_q, seq_len = q.shape[0], k.shape[0]
    mask = None
    if num_q != seq_len or (window is not None and window < seq_len):
        # NOTE: SDPA's is_causal aligns the mask top-left; a chunk after cached context needs it
        # bottom-right: query i sits at position seq_len - num_q + i.
        query_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]  # [Q, 1]
        keys = torch.arange(seq_len, device=q.device)[None, :]
        mask = keys <= query_pos  # [Q, S]
        if window is not None:
            mask &= keys > query_pos - window
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


def store(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """``cache`` viewed as ``[num_slots, KV, D]``; ``x`` ``[T', KV, D]`` goes to rows ``slots``."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, KV, D]
    if cache.dtype == FP8_DTYPE:
        # NOTE: index_copy_ has no fp8 kernel on CPU; copying the raw bytes is the same thing.
        quantized = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        flat.view(torch.uint8).index_copy_(0, slots, quantized.view(torch.uint8))
    elif cache.dtype == INT4_DTYPE:
        flat.index_copy_(0, slots, quantize_int4(x))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))
