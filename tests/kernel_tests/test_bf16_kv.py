"""A bf16 KV pool on the native kernels (bf16 mode's default; docs/kv_quantization.md, "bf16 KV").

The promise: the write rounds (to nearest even, torch's conversion bit for bit); every read
widens exactly, so each kernel over a bf16 pool is bitwise the same kernel over an fp32 pool
holding the rounded values, and a prefill row is still bitwise the decode of its position. Where
the build has AVX512-BF16 the attention kernels instead attend a bf16 pool in bf16 dot products
(test_bf16_attention.py); the widened reads here are what every other build and shape runs. Both
builds (AVX-512 and the portable C a CPU without it runs); cache contents random, blocks shuffled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.kv_pool import KVPool
from services.model_runner.native import load_kernels

from .test_paged_attention import Batch, make_batch

VARIANTS = ["native", "portable"]
# decodes long and short, prefill chunks after cached context and from 0, padding rows
QUERY_LENS = [1, 37, 16, 1, 9, 100]
SEQ_LENS = [20, 37, 49, 300, 130, 100]


@pytest.fixture(params=VARIANTS)
def backend(request: pytest.FixtureRequest) -> CpuAttentionBackend:
    b = CpuAttentionBackend(portable=request.param == "portable")
    assert b.native_kernels is not None, "the native kernels did not build on this machine"
    return b


def _forward(backend: TorchAttentionBackend, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return backend.forward(batch.query, k, v, batch.meta, batch.query.shape[-1] ** -0.5)


@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 32, 40])
@pytest.mark.parametrize("block_size", [1, 16])
def test_a_bf16_pool_reads_as_the_fp32_pool_of_its_values(
    backend: CpuAttentionBackend, block_size: int, head_dim: int, queries_per_kv: int, window: int
) -> None:
    """Decodes (the paged kernel, or its portable loops for head_dim 40) and prefill chunks (the
    prefill kernel; each row as the decode of its position for head_dim 40 or the portable build), with
    and without a sliding window: bitwise the fp32 pool holding the bf16 values, except where the
    build attends a bf16 pool in bf16 dot products (head_dim a multiple of 32, an even block size,
    AVX512-BF16: test_bf16_attention.py pins that arithmetic), which is within bf16 rounding of it."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, block_size=block_size, head_dim=head_dim,
                       queries_per_kv=queries_per_kv, num_kv_heads=2, num_pad_tokens=3, cache_dtype=torch.bfloat16,
                       seed=head_dim + block_size)  # fmt: skip
    if window:
        batch = dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, window=window))
    assert batch.k_cache.dtype == torch.bfloat16
    n = batch.num_real_tokens
    out = _forward(backend, batch, batch.k_cache, batch.v_cache)
    wide = _forward(backend, batch, batch.k_cache.float(), batch.v_cache.float())
    assert out.dtype == torch.float32
    kernels = backend.native_kernels
    assert kernels is not None
    if kernels.attention_bf16_dots and head_dim % 32 == 0 and block_size % 2 == 0:
        assert not torch.equal(out[:n], wide[:n])
        torch.testing.assert_close(out[:n], wide[:n], atol=1.5e-2, rtol=1e-2)
        return
    assert torch.equal(out[:n], wide[:n])
    # and the torch reference over the same values agrees as two fp32 implementations do
    reference = _forward(TorchAttentionBackend(), batch, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out[:n], reference[:n], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "block_size", "window"),
                         [(3, 64, 16, 0), (2, 128, 4, 0), (3, 64, 16, 20), (1, 16, 1, 7)])  # fmt: skip
@pytest.mark.parametrize("variant", [*VARIANTS, "plain"])
def test_a_prefill_row_is_bitwise_the_decode_of_its_position_over_bf16(
    queries_per_kv: int, head_dim: int, block_size: int, window: int, variant: str
) -> None:
    """The same 45 query rows over a bf16 pool as one prefill chunk and as 45 decodes (row j
    seeing its own prefix, or its window of it): bitwise equal."""
    chunk = make_batch([45], [60], block_size=block_size, head_dim=head_dim, queries_per_kv=queries_per_kv,
                       num_kv_heads=2, cache_dtype=torch.bfloat16, seed=head_dim + window)  # fmt: skip
    meta = dataclasses.replace(chunk.meta, window=window or None)
    backend = CpuAttentionBackend(portable=variant == "portable", plain=variant == "plain")
    as_chunk = backend.forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, head_dim**-0.5)
    decodes = dataclasses.replace(
        meta, query_start_loc=torch.arange(46, dtype=torch.int32), seq_lens=torch.arange(16, 61, dtype=torch.int32),
        block_tables=chunk.meta.block_tables.repeat(45, 1), max_query_len=1,
    )  # fmt: skip
    as_decodes = backend.forward(chunk.query, chunk.k_cache, chunk.v_cache, decodes, head_dim**-0.5)
    assert torch.equal(as_chunk[:45], as_decodes[:45])


def _bits(x: torch.Tensor) -> list[int]:
    return x.view(torch.int16).tolist()


def _write(backend: TorchAttentionBackend, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
           blocks: int = 6, block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    shape = (blocks, block_size, key.shape[1], key.shape[2])
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    return k_cache, v_cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_write_rounds_to_nearest_even(variant: str) -> None:
    """Pinned values (bf16 keeps 7 fraction bits: its step at 1 is 2^-7): above half a step rounds
    up, an exact half to the even neighbour either way; subnormals kept; inf and NaN; then random
    values of every magnitude, bit for bit torch's fp32 -> bf16 (the torch backend's write)."""
    backend = CpuAttentionBackend(portable=variant == "portable")
    cases = [
        (1 + 2**-8 + 2**-9, 1 + 2**-7),  # above half: up
        (1 + 2**-8, 1.0),  # a tie: to even (1)
        (1 + 3 * 2**-8, 1 + 2**-6),  # a tie: to even (1 + 2^-6, not 1 + 2^-7)
        (-(1 + 2**-8 + 2**-9), -(1 + 2**-7)),
        (1 + 2**-8 - 2**-20, 1.0),  # below half: down
        (2**-130, 2**-130),  # a subnormal (exact in bf16): kept, not flushed
        (float("inf"), float("inf")),
        (3.4e38, float("inf")),  # past bf16's largest finite value
    ]
    values = torch.tensor([c[0] for c in cases] + [float("nan")] * 8, dtype=torch.float32).view(2, 1, 8)
    slots = torch.tensor([5, 9], dtype=torch.int64)
    k_cache, v_cache = _write(backend, values, -values, slots)
    k_rows = k_cache.view(-1, 8)
    assert k_rows[5].float().tolist() == [c[1] for c in cases]
    assert _bits(k_rows[9]) == [0x7FC0] * 8  # NaN: torch's quiet NaN
    assert torch.equal(v_cache.view(-1, 8)[5].float(), -k_rows[5].float())
    assert k_rows[[r for r in range(24) if r not in (5, 9)]].count_nonzero() == 0  # only the named slots

    gen = torch.Generator().manual_seed(3)
    key = torch.randn(20, 2, 32, generator=gen) * torch.exp2(torch.randint(-140, 120, (20, 2, 32), generator=gen))
    value = torch.randn(20, 2, 32, generator=gen)
    slots = torch.randperm(24, generator=gen)[:20]
    slots[3] = -1  # padding: skipped
    native = _write(backend, key, value, slots)
    reference = _write(TorchAttentionBackend(), key, value, slots)
    assert _bits(native[0]) == _bits(reference[0]) and _bits(native[1]) == _bits(reference[1])


def test_the_torch_backend_over_bf16_is_the_same_values_in_fp32() -> None:
    """The torch reference takes a bf16 pool too (fp32 weights, ``kv_cache_dtype=bfloat16`` on
    ``attention_backend=torch``): it widens what it gathers, so its output is its output over
    the fp32 pool of the same values."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, head_dim=64, queries_per_kv=3, num_pad_tokens=2,
                       cache_dtype=torch.bfloat16, seed=11)  # fmt: skip
    n = batch.num_real_tokens
    torch_backend = TorchAttentionBackend()
    out = _forward(torch_backend, batch, batch.k_cache, batch.v_cache)
    assert torch.equal(out[:n], _forward(torch_backend, batch, batch.k_cache.float(), batch.v_cache.float())[:n])


def test_a_bf16_pool_holds_twice_the_blocks_of_fp32() -> None:
    """The same budget: 2 layers x (K, V) x 4 tokens x 2 heads x 8 dims = 256 elements a block,
    1,024 bytes in fp32, 512 in bf16."""
    geometry: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    budget = 10 * 1024 + 700
    with KVPool(**geometry, memory_bytes=budget, dtype=torch.float32) as fp32, \
            KVPool(**geometry, memory_bytes=budget, dtype=torch.bfloat16) as bf16:  # fmt: skip
        assert (fp32.bytes_per_block, fp32.num_blocks) == (1024, 10)
        assert (bf16.bytes_per_block, bf16.num_blocks) == (512, 21)
        assert bf16.tensor.shape == (2, 2, 21, 4, 2, 8) and bf16.kv_cache_dtype == "bfloat16"


def test_the_bf16_entry_points_are_built() -> None:
    kernels = load_kernels()
    assert kernels is not None
    assert None not in (kernels.paged_decode_bf16, kernels.prefill_attention_bf16, kernels.write_kv_bf16)
