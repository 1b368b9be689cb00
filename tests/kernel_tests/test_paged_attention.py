"""The unified Triton paged-attention kernel against torch (CPU, ``TRITON_INTERPRET=1``, tiny shapes).

Two references: ``paged_attention_ref`` (gathers through the same block tables), and, end to end
through the backend, dense causal attention over K/V that never went through the paged cache.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch

from services.model_runner.attention.base import AttentionBackend, AttentionMetadata
from services.model_runner.attention.kernels.paged_attention import paged_attention, paged_attention_ref
from services.model_runner.attention.triton_backend import TritonAttentionBackend

FP8 = torch.float8_e4m3fn
TOLERANCE = {  # query dtype -> (atol, rtol)
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 1e-2),  # the interpreter's fp32 -> bf16 cast truncates: up to 1 bf16 ulp
}


@dataclass
class Batch:
    """One step's attention inputs, with random cache contents everywhere (so a wrong block shows)."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def num_real_tokens(self) -> int:
        return int(self.meta.query_start_loc[-1])


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    queries_per_kv: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    shuffle_blocks: bool = True,
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """Builds a flat varlen batch; sequence ``i`` has ``query_lens[i]`` new of ``seq_lens[i]`` tokens.

    Blocks come from a pool with spare blocks, taken in shuffled order unless ``shuffle_blocks`` is
    False; block 0 (the null block) pads the block tables. An fp8 cache holds quantised random K/V
    with per-tensor scales, the way ``write_kv`` would have stored them.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1 if shuffle_blocks else torch.arange(1, num_blocks)
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = ids[taken : taken + n]
        taken += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_real, v_real = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_scale = v_scale = 1.0
    if cache_dtype == FP8:
        k_scale, v_scale = float(k_real.abs().max()) / 448, float(v_real.abs().max()) / 448
        k_real, v_real = k_real / k_scale, v_real / v_scale
    k_cache, v_cache = k_real.to(cache_dtype), v_real.to(cache_dtype)

    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(query_start_loc[-1]) + num_pad_tokens
    query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long)  # unused by forward; -1 = padding
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return Batch(query, k_cache, v_cache, meta, k_scale, v_scale)


def run_kernel(batch: Batch, softmax_scale: float | None = None, **tiles: int | bool) -> torch.Tensor:
    m = batch.meta
    scale = softmax_scale or batch.query.shape[-1] ** -0.5
    return paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        m.max_query_len,
        scale,
        batch.k_scale,
        batch.v_scale,
        **tiles,  # type: ignore[arg-type]
    )


def run_reference(batch: Batch, softmax_scale: float | None = None) -> torch.Tensor:
    m = batch.meta
    scale = softmax_scale or batch.query.shape[-1] ** -0.5
    return paged_attention_ref(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        scale,
        batch.k_scale,
        batch.v_scale,
    )


def assert_matches_reference(batch: Batch, **tiles: int | bool) -> None:
    out = run_kernel(batch, **tiles)
    expected = run_reference(batch)
    n = batch.num_real_tokens
    atol, rtol = TOLERANCE[batch.query.dtype]
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)


COMPOSITIONS = {  # name -> (query_lens, seq_lens)
    "decode": ([1, 1, 1, 1], [1, 7, 16, 37]),
    "prefill": ([5, 17, 1], [5, 17, 1]),
    "chunk_with_context": ([9], [30]),
    "mixed": ([6, 1, 13, 1, 2], [6, 40, 21, 9, 34]),
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_batch_compositions(composition: str, block_size: int) -> None:
    query_lens, seq_lens = COMPOSITIONS[composition]
    assert_matches_reference(make_batch(query_lens, seq_lens, block_size=block_size))


def test_contiguous_blocks() -> None:
    assert_matches_reference(make_batch([4, 1, 7], [4, 19, 30], block_size=4, shuffle_blocks=False))


def test_padding_rows_and_empty_queries() -> None:
    """Batch padding (rows past query_start_loc[-1]) is left unwritten; a sequence with no new
    tokens in this step contributes no rows."""
    batch = make_batch([3, 0, 1], [3, 8, 12], block_size=4, num_pad_tokens=5)
    n = batch.num_real_tokens
    out = torch.full_like(batch.query, 7.0)
    m = batch.meta
    paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        m.max_query_len,
        batch.query.shape[-1] ** -0.5,
        out=out,
    )
    torch.testing.assert_close(out[:n], run_reference(batch)[:n], atol=1e-4, rtol=1e-4)
    assert bool((out[n:] == 7.0).all())


@pytest.mark.parametrize("queries_per_kv", [1, 2, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 48, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_shapes(block_size: int, head_dim: int, queries_per_kv: int) -> None:
    """Cache block sizes, head dims (48 is padded to 64 by masks) and GQA ratios (3 is padded to a
    head group of 4 by masks), on a mixed batch."""
    batch = make_batch(
        [5, 1, 3],
        [5, 23, 18],
        block_size=block_size,
        head_dim=head_dim,
        queries_per_kv=queries_per_kv,
        seed=block_size + head_dim + queries_per_kv,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, FP8),
        (torch.bfloat16, FP8),
        (torch.float32, FP8),
    ],
    ids=["fp16", "bf16", "fp16-fp8cache", "bf16-fp8cache", "fp32-fp8cache"],
)
def test_dtypes(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """16-bit queries and caches, and fp8 caches with scales (the reference dequantises the same
    fp8 values, so the tolerance is the query dtype's)."""
    batch = make_batch(
        [6, 1, 13, 1], [6, 40, 21, 9], block_size=4, queries_per_kv=3, dtype=dtype, cache_dtype=cache_dtype
    )
    if cache_dtype == FP8:
        assert batch.k_scale != 1.0 and batch.v_scale != 1.0
    assert_matches_reference(batch)


def test_fp16_through_fp32_matmuls() -> None:
    """The fp32-matmul path with 16-bit inputs (what bf16 takes under the interpreter)."""
    batch = make_batch([6, 1], [6, 40], block_size=4, dtype=torch.float16)
    assert_matches_reference(batch, dot_fp32=True)


@pytest.mark.parametrize(("block_m", "tile_n"), [(16, 16), (64, 16), (16, 64), (128, 32)])
def test_tile_sizes(block_m: int, tile_n: int) -> None:
    """Query tiles spanning one or several tiles of a chunk, key tiles smaller or larger than a
    cache block (gathered per key through the block table)."""
    batch = make_batch([21, 1, 3], [50, 33, 3], block_size=8, queries_per_kv=2)
    assert_matches_reference(batch, block_m=block_m, tile_n=tile_n)


def test_large_scores_stay_finite() -> None:
    """Online softmax rescaling with scores in the hundreds (no overflow, no NaN)."""
    batch = make_batch([4, 1], [20, 35], block_size=4)
    out = run_kernel(batch, softmax_scale=20.0)
    assert bool(out.isfinite().all())
    torch.testing.assert_close(out, run_reference(batch, softmax_scale=20.0), atol=1e-4, rtol=1e-4)


def test_rejects_bad_arguments() -> None:
    batch = make_batch([2], [2])
    with pytest.raises(ValueError, match="block_m"):
        run_kernel(batch, block_m=24)
    with pytest.raises(ValueError, match="multiple"):
        run_kernel(Batch(batch.query[:, :3], batch.k_cache, batch.v_cache, batch.meta))


# --- end to end through the backend ------------------------------------------------------------


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [q_len, heads, dim] are the last q_len positions of ``k``/``v`` [seq_len, kv_heads, dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
    hidden = torch.arange(k.shape[0])[None, :] > q_pos[:, None]  # [q_len, seq_len]
    scores = torch.einsum("qhd,khd->hqk", q, k).mul(scale).masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _step(
    spans: list[tuple[int, int]],  # per sequence: this step's new positions [a, b)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    block_size: int,
    rows: list[torch.Tensor],  # per sequence: [seq_len, ...] all positions of one input
    num_pad: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The flat step input: this step's rows of ``rows``, then ``num_pad`` padding rows (slot -1)."""
    slots = []
    for s, (a, e) in enumerate(spans):
        slots += [int(block_tables[s, p // block_size]) * block_size + p % block_size for p in range(a, e)]
    slot_mapping = torch.tensor(slots + [-1] * num_pad, dtype=torch.long)
    flat = torch.cat(
        [*(r[a:e] for r, (a, e) in zip(rows, spans, strict=True)), torch.randn(num_pad, *rows[0].shape[1:])]
    )
    query_lens = [e - a for a, e in spans]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([e for _, e in spans], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(e for _, e in spans),
    )
    return flat, slot_mapping, meta


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["fp32", "fp8"])
def test_backend_two_steps_against_dense_attention(cache_dtype: torch.dtype) -> None:
    """Step 1 prefills two prompts (the second only partly), step 2 decodes the first and runs the
    second's next chunk, each step with two padding rows; every real output row must equal dense
    causal attention over the true K/V, which never went through the paged cache."""
    torch.manual_seed(5)
    backend: AttentionBackend = TritonAttentionBackend()
    assert backend.name == "triton"
    block_size, num_kv_heads, queries_per_kv, head_dim, num_blocks = 4, 2, 3, 16, 12
    lengths = [10, 19]  # each sequence's context after step 2
    steps = [[(0, 9), (0, 12)], [(9, 10), (12, 19)]]
    block_tables = torch.tensor([[7, 2, 9, 0, 0], [4, 11, 1, 5, 3]], dtype=torch.int32)
    keys = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    queries = [torch.randn(n, num_kv_heads * queries_per_kv, head_dim) for n in lengths]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = (0.01, 0.02) if cache_dtype == FP8 else (1.0, 1.0)
    scale = head_dim**-0.5

    for spans in steps:
        key, slot_mapping, meta = _step(spans, block_tables, block_size, keys, num_pad=2)
        value, _, _ = _step(spans, block_tables, block_size, values, num_pad=2)
        query, _, _ = _step(spans, block_tables, block_size, queries, num_pad=2)
        backend.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        out = backend.forward(query, k_cache, v_cache, meta, scale, k_scale, v_scale)

        row = 0
        for s, (a, e) in enumerate(spans):
            k_true, v_true = keys[s][:e], values[s][:e]
            if cache_dtype == FP8:  # what the cache can hold: the fp8-rounded values
                k_true = (k_true / k_scale).to(FP8).float() * k_scale
                v_true = (v_true / v_scale).to(FP8).float() * v_scale
            expected = _dense_causal(queries[s][a:e], k_true, v_true, scale)
            torch.testing.assert_close(out[row : row + e - a], expected, atol=1e-4, rtol=1e-4)
            row += e - a

    # The null block 0 and the blocks no sequence owns were never written (padding rows skipped).
    unused = set(range(num_blocks)) - {int(b) for b in block_tables.flatten() if b}
    for b in sorted(unused):
        assert not bool(k_cache[b].float().any() or v_cache[b].float().any()), f"block {b} was written"


@pytest.mark.skipif(
    importlib.util.find_spec("services.model_runner.attention.torch_backend") is None,
    reason="torch backend not written yet",
)
def test_agrees_with_torch_backend() -> None:
    from services.model_runner.attention.torch_backend import TorchAttentionBackend

    torch_impl: AttentionBackend = TorchAttentionBackend()
    batch = make_batch([6, 1, 13, 1], [6, 40, 21, 9], block_size=4, queries_per_kv=3, num_pad_tokens=2)
    scale = batch.query.shape[-1] ** -0.5
    out = TritonAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    expected = torch_impl.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    n = batch.num_real_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-4, rtol=1e-4)
    # write_kv agrees too, padding rows included.
    key = torch.randn(batch.query.shape[0], 2, batch.query.shape[-1])
    slots = torch.tensor([5, -1, 17, 30, -1, 2] + [-1] * (key.shape[0] - 6), dtype=torch.long)
    caches = [torch.zeros_like(batch.k_cache) for _ in range(4)]
    TritonAttentionBackend().write_kv(key, -key, caches[0], caches[1], slots)
    torch_impl.write_kv(key, -key, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
