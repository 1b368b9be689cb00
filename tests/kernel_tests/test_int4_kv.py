"""The INT4 KV cache's writers and readers against the torch reference (``attention/int4.py``).

Writes (torch, native ``int4_kv.c``, Triton under ``TRITON_INTERPRET=1``) must give the reference's
bytes exactly. Reads: every path dequantizes to the same fp32 values (exact: small integer x float16),
so the outputs differ from the reference only by the attention's own summation order and exp,
the tolerance of the fp32 paths (``test_native_cpu.py``, ``test_paged_attention.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from services.model_runner.attention import int4_native
from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.int4 import dequantize_int4, quantize_int4
from services.model_runner.attention.kernels.int4_kv import write_kv_int4
from services.model_runner.attention.kernels.paged_attention import paged_attention, paged_attention_ref
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.native import load_kernels
from shared.kv_layout import int4_row_bytes

ATOL = RTOL = 1e-4  # fp32 attention over identical dequantized K/V: summation order only


def _cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Random bytes: a slot the writer skips or misses keeps garbage that a comparison catches."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_size, kv_heads, int4_row_bytes(head_dim)), dtype=torch.uint8,
                         generator=gen)  # fmt: skip


def _reference_write(key: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    expected = cache.clone()
    keep = slots >= 0
    expected.view(-1, *cache.shape[2:])[slots[keep]] = quantize_int4(key[keep])
    return expected


def _inputs(num_tokens: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * 3
    key[0, 0, :] = 0.0  # an all-zero row: scale 0, every nibble 8
    key[1, 0, 5] = 40.0  # an outlier channel
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    return key, value


SLOTS = torch.tensor([5, -1, 9, 12, 4, -1, 7, 30], dtype=torch.int64)


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_triton_write_is_the_reference_bytes(head_dim: int) -> None:
    key, value = _inputs(8, 2, head_dim, seed=head_dim)
    k_cache, v_cache = _cache(9, 4, 2, head_dim, 1), _cache(9, 4, 2, head_dim, 2)
    expected_k, expected_v = _reference_write(key, k_cache, SLOTS), _reference_write(value, v_cache, SLOTS)
    write_kv_int4(key, value, k_cache, v_cache, SLOTS)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_native_write_is_the_reference_bytes(head_dim: int, portable: bool) -> None:
    kernels = load_kernels(portable)
    assert kernels is not None and kernels.write_kv_int4 is not None
    key, value = _inputs(8, 2, head_dim, seed=head_dim)
    k_cache, v_cache = _cache(9, 4, 2, head_dim, 1), _cache(9, 4, 2, head_dim, 2)
    expected_k, expected_v = _reference_write(key, k_cache, SLOTS), _reference_write(value, v_cache, SLOTS)
    written = kernels.write_kv_int4(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        SLOTS.data_ptr(), 8, 2, head_dim, 9 * 4,
    )  # fmt: skip
    assert written == 6
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def _batch(query_lens: list[int], seq_lens: list[int], head_dim: int, seed: int = 0,
           kv_heads: int = 2, group: int = 2, block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, AttentionMetadata]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = ids[taken : taken + n]
        taken += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = quantize_int4(torch.randn(shape, generator=gen) * 2)
    v_cache = quantize_int4(torch.randn(shape, generator=gen))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata(torch.full((query.shape[0],), -1, dtype=torch.int64), starts,
                             torch.tensor(seq_lens, dtype=torch.int32), tables, max(query_lens), max(seq_lens))
    return query, k_cache, v_cache, meta


def _reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    return paged_attention_ref(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               query.shape[-1] ** -0.5)  # fmt: skip


MIXED = ([1, 5, 1, 8], [9, 13, 1, 8])  # decodes, a chunk after cached context, a one-token sequence, a prefill


@pytest.mark.parametrize("head_dim", [16, 64])
def test_references_agree(head_dim: int) -> None:
    """The torch backend (gather + SDPA) and paged_attention_ref read the INT4 cache alike."""
    query, k_cache, v_cache, meta = _batch(*MIXED, head_dim)
    out = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, _reference(query, k_cache, v_cache, meta), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_triton_attention_matches_reference(head_dim: int) -> None:
    query, k_cache, v_cache, meta = _batch(*MIXED, head_dim, seed=1)
    out = paged_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                          meta.max_query_len, head_dim**-0.5)  # fmt: skip
    torch.testing.assert_close(out, _reference(query, k_cache, v_cache, meta), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_native_attention_matches_reference(head_dim: int, portable: bool) -> None:
    query, k_cache, v_cache, meta = _batch(*MIXED, head_dim, seed=2)
    backend = CpuAttentionBackend(portable=portable)
    out = backend.forward(query, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, _reference(query, k_cache, v_cache, meta), atol=ATOL, rtol=RTOL)


def test_native_prefill_rows_are_bitwise_decodes() -> None:
    """A 12-token prefill in one chunk, in chunks of 5 + 7, and as 12 decodes: the same bits, so
    prefix-cache hits and chunked prefill give a cold run's numbers in INT4 mode."""
    query, k_cache, v_cache, meta = _batch([12], [12], 64, seed=3)
    backend = CpuAttentionBackend()
    whole = backend.forward(query, k_cache, v_cache, meta, 0.125)
    for splits in ([5, 7], [1] * 12):
        rows, done = [], 0
        for n in splits:
            done += n
            part = AttentionMetadata(meta.slot_mapping[:n], torch.tensor([0, n], dtype=torch.int32),
                                     torch.tensor([done], dtype=torch.int32), meta.block_tables, n, done)
            rows.append(backend.forward(query[done - n : done], k_cache, v_cache, part, 0.125))
        assert torch.equal(torch.cat(rows), whole), splits


def test_write_paths_store_what_the_readers_read() -> None:
    """Written by the torch and the cpu backends, the cache dequantizes to the reference's values."""
    key, value = _inputs(8, 2, 32, seed=4)
    caches = []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        k_cache, v_cache = _cache(9, 4, 2, 32, 1), _cache(9, 4, 2, 32, 2)
        backend.write_kv(key, value, k_cache, v_cache, SLOTS)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    rows = caches[0][0].view(-1, 2, int4_row_bytes(32))[SLOTS[SLOTS >= 0]]
    assert torch.equal(dequantize_int4(rows), dequantize_int4(quantize_int4(key[SLOTS >= 0])))


@dataclass(frozen=True)
class _Rows:
    """A per-row plan as ``int4_native.forward`` reads it."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    max_len: int


@pytest.mark.parametrize("window", [0, 1, 5, 64])
def test_native_attention_honours_a_sliding_window(window: int) -> None:
    """Row at position p sees keys p - window < j <= p (0 = all): against dense attention over the
    dequantized keys, on a 13-token sequence of 4 blocks of 4."""
    query, k_cache, v_cache, meta = _batch([13], [13], 32, seed=5)
    kernels = load_kernels()
    assert kernels is not None
    lens = torch.arange(1, 14, dtype=torch.int32)
    plan = _Rows(torch.arange(13, dtype=torch.int32), lens, meta.block_tables.repeat(13, 1).contiguous(), 13)
    out = int4_native.forward(kernels, plan, query, k_cache, v_cache, 32**-0.5, window)
    assert out is not None
    blocks = meta.block_tables[0, :4].long()
    k = dequantize_int4(k_cache[blocks].flatten(0, 1)[:13]).repeat_interleave(2, dim=1)  # [13, H, D]
    v = dequantize_int4(v_cache[blocks].flatten(0, 1)[:13]).repeat_interleave(2, dim=1)
    keys, pos = torch.arange(13)[None, :], torch.arange(13)[:, None]
    visible = (keys <= pos) & ((keys > pos - window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", query, k) * 32**-0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
