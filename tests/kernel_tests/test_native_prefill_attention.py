"""``native/prefill_attention.c``: prefill chunks' causal attention on the paged cache.

Against the torch reference (SDPA with a bottom-right causal mask over the gathered chunk), and
the property the kernel exists to keep: a row's bits do not depend on how its prompt was split
into chunks, nor on the thread count. Cache contents random, blocks shuffled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.torch_backend import TorchAttentionBackend

from .test_paged_attention import make_batch

# The AVX-512 build's tiled kernel, and the builds without AVX-512 (AVX2 paths) or without AVX2 too
# (plain C), whose chunks run every row as the decode of its position.
VARIANTS = ["native", "portable", "plain"]


def _forward(backend: TorchAttentionBackend, batch: object) -> torch.Tensor:
    b = batch  # a test_paged_attention.Batch
    scale = b.query.shape[-1] ** -0.5  # type: ignore[attr-defined]
    return backend.forward(b.query, b.k_cache, b.v_cache, b.meta, scale)  # type: ignore[attr-defined]


@pytest.mark.parametrize("queries_per_kv", [1, 3, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 32, 48])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_chunks_match_the_torch_reference(block_size: int, head_dim: int, queries_per_kv: int) -> None:
    """Whole prompts and chunks after cached context (bottom-right mask), lengths straddling the
    kernel's 16-key tiles and its 8-row work items, beside decodes in the same step."""
    query_lens = [1, 37, 16, 1, 9, 100]
    seq_lens = [20, 37, 49, 300, 130, 100]
    batch = make_batch(query_lens, seq_lens, block_size=block_size, head_dim=head_dim, queries_per_kv=queries_per_kv,
                       num_kv_heads=2, num_pad_tokens=3, seed=block_size + head_dim + queries_per_kv)  # fmt: skip
    backend = CpuAttentionBackend()
    plan = backend._plan_native(batch.meta, block_size)
    assert [(c.start, c.end) for c in plan.chunks] == [(1, 38), (38, 54), (55, 64), (64, 164)]
    n = batch.num_real_tokens
    out = _forward(backend, batch)
    expected = _forward(TorchAttentionBackend(), batch)
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_dim_the_tiles_do_not_take_runs_as_decodes(variant: str) -> None:
    """head_dim 40 (not a multiple of 16; and every shape in the portable build): the chunk's rows
    run as decodes of their positions. Not SDPA over the gathered chunk, whose bits depend on the
    chunk's length and offset (the cache would change the answer); close to it."""
    batch = make_batch([1, 21], [9, 21], head_dim=40, queries_per_kv=3, num_kv_heads=2)
    backend = CpuAttentionBackend(portable=variant == "portable", plain=variant == "plain")
    out = _forward(backend, batch)
    expected = _forward(TorchAttentionBackend(), batch)
    torch.testing.assert_close(out[1:22], expected[1:22], atol=2e-6, rtol=1e-5)
    decodes = dataclasses.replace(
        batch.meta, query_start_loc=torch.tensor([0, *range(1, 23)], dtype=torch.int32),
        seq_lens=torch.tensor([9, *range(1, 22)], dtype=torch.int32),
        block_tables=torch.cat([batch.meta.block_tables[:1], batch.meta.block_tables[1:2].repeat(21, 1)]),
        max_query_len=1,
    )  # fmt: skip
    as_decodes = backend.forward(batch.query, batch.k_cache, batch.v_cache, decodes, 40**-0.5)
    assert torch.equal(out[:22], as_decodes[:22])


@pytest.mark.parametrize("split", [[70], [1, 69], [16, 17, 37], [33, 37], [7] * 10])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("cache_dtype", "window"), [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 25)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_is_the_same_however_the_prompt_is_chunked(split: list[int], threads: int, cache_dtype: torch.dtype,
                                                          window: int, variant: str) -> None:  # fmt: skip
    """A 70-token prompt attended in one chunk or in consecutive chunks (each after the cached rows
    before it), on 1 or 3 threads, over an fp32 pool and a bf16 one (bf16 dot products where the
    build has them, test_bf16_attention.py), with and without a sliding window: every row bitwise
    the same."""
    whole = make_batch([70], [70], block_size=16, head_dim=64, queries_per_kv=3, num_kv_heads=3,
                       cache_dtype=cache_dtype, seed=5)  # fmt: skip
    meta_whole = dataclasses.replace(whole.meta, window=window or None)
    backend = CpuAttentionBackend(portable=variant == "portable", plain=variant == "plain")
    reference = backend.forward(whole.query, whole.k_cache, whole.v_cache, meta_whole, 64**-0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = 0
        for size in split:
            # the same cache and block table as the whole prompt, the chunk's own query rows
            meta = AttentionMetadata(
                slot_mapping=torch.full((size,), -1, dtype=torch.long),
                query_start_loc=torch.tensor([0, size], dtype=torch.int32),
                seq_lens=torch.tensor([start + size], dtype=torch.int32), block_tables=whole.meta.block_tables,
                max_query_len=size, max_seq_len=start + size, window=window or None,
            )  # fmt: skip
            query = whole.query[start : start + size].contiguous()
            out = backend.forward(query, whole.k_cache, whole.v_cache, meta, 64**-0.5)
            assert torch.equal(out, reference[start : start + size]), (split, start)
            start += size
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "block_size"),
                         [(3, 64, 16), (2, 128, 4), (16, 32, 16), (1, 16, 1), (2, 48, 16), (3, 40, 16),
                          (5, 96, 16)])  # fmt: skip
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prefill_row_is_bitwise_the_decode_of_its_position(queries_per_kv: int, head_dim: int,
                                                             block_size: int, variant: str) -> None:  # fmt: skip
    """The same 45 query rows as one prefill chunk and as 45 decodes (row j seeing its own
    prefix): bitwise equal, so a position computed once as a prefill row and once as a decode (a
    cold run's decode, a preempted request's recompute) has the same bits."""
    chunk = make_batch([45], [60], block_size=block_size, head_dim=head_dim, queries_per_kv=queries_per_kv,
                       num_kv_heads=2, seed=head_dim)  # fmt: skip
    backend = CpuAttentionBackend(portable=variant == "portable", plain=variant == "plain")
    as_chunk = _forward(backend, chunk)
    tables = chunk.meta.block_tables.repeat(45, 1)
    meta = dataclasses.replace(
        chunk.meta, query_start_loc=torch.arange(46, dtype=torch.int32),
        seq_lens=torch.arange(16, 61, dtype=torch.int32), block_tables=tables, max_query_len=1,
    )  # fmt: skip
    as_decodes = backend.forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, head_dim**-0.5)
    assert torch.equal(as_chunk[:45], as_decodes[:45])
