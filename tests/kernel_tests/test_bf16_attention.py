"""bf16 dot products in attention over a bf16 pool (``kv_elem.h``'s ``kv_bf16_dots``; bf16 mode's
default on a CPU with AVX512-BF16; docs/model_runner.md, "bf16 attention").

What is promised, and pinned here:
- the arithmetic: the scaled query and the softmax numerators rounded to bf16 (nearest even), K and
  V the pool's values, fp32 sums (scores over dimension pairs, the weighted V over key pairs, the
  normalising sum over the rounded numerators): on values where every sum is exact, the output is
  the formula's bits;
- the cache never changes the answer: a prefill row is bitwise the decode of its position, with or
  without a sliding window (whose first key may be odd: a key pair half outside the row); and
  however its prompt is chunked, on any thread count (test_native_prefill_attention.py, over a
  bf16 pool too);
- agreement with the fp32 reference (SDPA over the same bf16 values) within bf16 rounding;
- where it does not apply (no AVX512-BF16, head_dim not a multiple of 32, odd block sizes, the
  portable build) a bf16 pool is read widened into fp32 arithmetic, as test_bf16_kv.py pins.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.factory import cpu_flags
from services.model_runner.native import load_kernels

from .test_paged_attention import Batch, make_batch

# The build whose bf16 mode runs dot products (on an Intel CPU without AMX the default build runs
# bf16 mode in fp32 FMAs instead, native.bf16_in_fma, and never takes them; on an AMX CPU the default
# build attends on AMX tiles, test_amx_attention.py).
DOTS = load_kernels(bf16_fma=False, no_amx=True)
pytestmark = pytest.mark.skipif(
    DOTS is None or not DOTS.attention_bf16_dots,
    reason="bf16 attention needs a build with AVX512-BF16 (this CPU or compiler has none)",
)


def _backend() -> CpuAttentionBackend:
    """The native backend on the dot-product build."""
    backend = CpuAttentionBackend()
    backend.native_kernels = DOTS
    return backend


def test_which_shapes_take_bf16_dots() -> None:
    """kv_elem.h's kv_bf16_dots, the one rule both kernels and the runner's log follow: head_dim a
    multiple of 32 up to 256, an even block size, at most 128 query heads; never in the portable
    build (no AVX-512), where a bf16 pool is read widened."""
    kernels = DOTS
    assert kernels is not None and "avx512_bf16" in cpu_flags()
    takes = kernels.bf16_dots_for
    assert [bool(takes(h, d, b)) for h, d, b in [(9, 64, 16), (32, 128, 16), (128, 256, 2), (9, 32, 4)]] == [True] * 4
    assert [bool(takes(h, d, b)) for h, d, b in [(9, 48, 16), (9, 16, 16), (9, 288, 16), (9, 64, 1), (9, 64, 15),
                                                 (129, 64, 16)]] == [False] * 6  # fmt: skip
    portable = load_kernels(portable=True)
    assert portable is not None and not portable.attention_bf16_dots and not portable.bf16_dots_for(9, 64, 16)
    fma = load_kernels(bf16_fma=True)  # bf16 mode in fp32 FMAs: a bf16 pool is read widened, for every shape
    assert fma is not None and fma.linear_bf16_fma and not fma.attention_bf16_dots
    assert not any(fma.bf16_dots_for(h, d, b) for h, d, b in [(9, 64, 16), (32, 128, 16)])


def _bf16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())


def _exact_batch(num_q: int, seq_len: int, block_size: int, window: int, group: int = 3) -> tuple[Batch, list[int]]:
    """One sequence whose attention is exactly computable: q = (1 + 2^-10) e0 (bf16: e0), K of key i
    = -(i % 4) e0 (scores 0, -1, -2, -3: exp rounded to bf16 far from a rounding tie), V small
    integers. Every product and sum is then exact in fp32, in any order; only the rounding of q,
    of the numerators and the final 1 / sum x acc decide the bits. Returns the batch and the
    sequence's block table as a list."""
    batch = make_batch([num_q], [seq_len], block_size=block_size, head_dim=64, queries_per_kv=group,
                       num_kv_heads=2, cache_dtype=torch.bfloat16, seed=7)  # fmt: skip
    k, v = torch.zeros_like(batch.k_cache), torch.zeros_like(batch.v_cache)
    table = batch.meta.block_tables[0].tolist()
    for t in range(seq_len):
        blk, off = table[t // block_size], t % block_size
        k[blk, off, :, 0] = -float(t % 4)
        for h in range(2):
            v[blk, off, h] = torch.arange(64, dtype=torch.float32).remainder(7 + h + t).sub(3)
    q = torch.zeros_like(batch.query)
    q[..., 0] = 1 + 2**-10
    meta = dataclasses.replace(batch.meta, window=window or None)
    return Batch(q, k, v, meta, 1.0, 1.0), table


def _expected_row(batch: Batch, table: list[int], pos: int, window: int) -> torch.Tensor:
    """[H, D] the formula for the query at position pos: p_i = bf16(e^{s_i - max}), out =
    fp32(sum p_i v_i) * fp32(1 / sum p_i) (both sums exact here)."""
    first = pos + 1 - window if window and pos + 1 > window else 0
    keys = range(first, pos + 1)
    block_size = batch.k_cache.shape[1]
    scores = [-float(t % 4) for t in keys]  # bf16(q) . k exactly
    top = max(scores)
    p = [_bf16(float(torch.exp(torch.tensor(s - top, dtype=torch.float32)))) for s in scores]
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(sum(p), dtype=torch.float32)
    heads = batch.query.shape[1]
    group = heads // 2
    out = torch.zeros(heads, 64, dtype=torch.float32)
    for h in range(heads):
        acc = torch.zeros(64, dtype=torch.float64)
        for pi, t in zip(p, keys, strict=True):
            acc += pi * batch.v_cache[table[t // block_size], t % block_size, h // group].double()
        out[h] = acc.float() * inv
    return out


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("window", [0, 3, 4])
def test_the_arithmetic_on_exact_values(block_size: int, window: int) -> None:
    """Prefill rows (a 9-token prompt in one chunk) and decodes of every position: the formula's
    bits. With fp32 arithmetic (no query rounding) the scores would be -(1 + 2^-10) i and the bits
    different, so this fails if the bf16 path is not the one running."""
    batch, table = _exact_batch(9, 9, block_size, window)
    scale = 1.0
    prefill = _backend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    decodes = dataclasses.replace(
        batch.meta, query_start_loc=torch.arange(10, dtype=torch.int32),
        seq_lens=torch.arange(1, 10, dtype=torch.int32),
        block_tables=batch.meta.block_tables.repeat(9, 1), max_query_len=1,
    )  # fmt: skip
    decoded = _backend().forward(batch.query, batch.k_cache, batch.v_cache, decodes, scale)
    for pos in range(9):
        expected = _expected_row(batch, table, pos, window)
        assert torch.equal(prefill[pos], expected), pos
        assert torch.equal(decoded[pos], expected), pos
    # and the same pool read in fp32 arithmetic (an fp32 pool of the same values) differs
    wide = _backend().forward(batch.query, batch.k_cache.float(), batch.v_cache.float(), batch.meta, scale)
    assert not torch.equal(wide[:9], prefill[:9])


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "block_size", "window"),
                         [(3, 64, 16, 0), (2, 128, 4, 0), (3, 64, 16, 20), (3, 64, 16, 21), (1, 32, 2, 7),
                          (16, 64, 16, 0), (4, 96, 8, 13), (5, 96, 16, 0)])  # fmt: skip
def test_a_prefill_row_is_bitwise_the_decode_of_its_position(
    queries_per_kv: int, head_dim: int, block_size: int, window: int
) -> None:
    """45 query rows as one prefill chunk and as 45 decodes (row j seeing its own prefix, or its
    window of it: odd and even first keys): bitwise equal, and within bf16 rounding of SDPA."""
    chunk = make_batch([45], [60], block_size=block_size, head_dim=head_dim, queries_per_kv=queries_per_kv,
                       num_kv_heads=2, cache_dtype=torch.bfloat16, seed=head_dim + window)  # fmt: skip
    meta = dataclasses.replace(chunk.meta, window=window or None)
    scale = head_dim**-0.5
    as_chunk = _backend().forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, scale)
    decodes = dataclasses.replace(
        meta, query_start_loc=torch.arange(46, dtype=torch.int32), seq_lens=torch.arange(16, 61, dtype=torch.int32),
        block_tables=chunk.meta.block_tables.repeat(45, 1), max_query_len=1,
    )  # fmt: skip
    as_decodes = _backend().forward(chunk.query, chunk.k_cache, chunk.v_cache, decodes, scale)
    assert torch.equal(as_chunk[:45], as_decodes[:45])
    reference = TorchAttentionBackend().forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, scale)
    torch.testing.assert_close(as_chunk[:45], reference[:45], atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_a_mixed_step_agrees_with_the_fp32_reference(head_dim: int, queries_per_kv: int) -> None:
    """Decodes long and short beside prefill chunks after cached context and from 0, padding rows:
    within bf16 rounding of SDPA over the same values (about 2^-9 relative on the query and the
    numerators), and each decode bitwise a one-row batch of itself."""
    batch = make_batch([1, 37, 16, 1, 9, 100], [20, 37, 49, 300, 130, 100], block_size=16, head_dim=head_dim,
                       queries_per_kv=queries_per_kv, num_kv_heads=2, num_pad_tokens=3, cache_dtype=torch.bfloat16,
                       seed=head_dim + queries_per_kv)  # fmt: skip
    n = batch.num_real_tokens
    scale = head_dim**-0.5
    out = _backend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    reference = TorchAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(out[:n], reference[:n], atol=1.5e-2, rtol=1e-2)
    # the decode of sequence 3 (300 keys) alone
    alone = dataclasses.replace(
        batch.meta, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=batch.meta.seq_lens[3:4],
        block_tables=batch.meta.block_tables[3:4], max_query_len=1, max_seq_len=300,
    )  # fmt: skip
    row = batch.query[54:55].contiguous()
    assert torch.equal(_backend().forward(row, batch.k_cache, batch.v_cache, alone, scale)[0], out[54])
