"""Attention over a bf16 pool on AMX tiles (``native/attention_amx.c``; ``kv_elem.h``'s ``kv_amx``:
where the process runs its bf16 GEMMs on AMX; docs/model_runner.md, "AMX attention").

What is promised, and pinned here (on a CPU whose kernel grants AMX; skipped elsewhere):
- which shapes take it: those ``kv_bf16_dots`` takes, in the AMX build only;
- the arithmetic: the scaled query and the softmax numerators rounded to bf16, K and V the pool's
  values, fp32 sums: on values where every sum is exact, the formula's bits (the vdpbf16ps path's
  test, test_bf16_attention.py, run on the AMX build);
- the cache never changes the answer: a prefill row is bitwise the decode of its position at every
  shape it takes (head_dim 32-256, 1-16 query heads per KV head, block sizes 2-32, windows with odd
  and even first keys), in a batch of decodes of other lengths, on 1 or 3 threads; a prompt's
  chunks give its rows' bits however it is split (test_native_prefill_attention.py);
- agreement with SDPA over the same bf16 values within bf16 rounding; other bits than the
  vdpbf16ps path's (so the tests above ran this kernel).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.native import load_kernels

from .test_bf16_attention import _exact_batch, _expected_row
from .test_paged_attention import make_batch

AMX = load_kernels(bf16_fma=False)
DOTS = load_kernels(bf16_fma=False, no_amx=True)
pytestmark = pytest.mark.skipif(
    AMX is None or AMX.kv_amx_for is None or not AMX.kv_amx_for(9, 64, 16),
    reason="AMX attention needs a CPU with AMX-BF16 whose kernel grants the tile state",
)


def _backend(kernels: object = None) -> CpuAttentionBackend:
    backend = CpuAttentionBackend()
    backend.native_kernels = kernels or AMX
    return backend


def _decodes_of(meta: object, num_q: int, seq_len: int) -> object:
    """The chunk's rows as num_q decodes: row j sees seq_len - num_q + 1 + j keys."""
    return dataclasses.replace(
        meta, query_start_loc=torch.arange(num_q + 1, dtype=torch.int32),
        seq_lens=torch.arange(seq_len - num_q + 1, seq_len + 1, dtype=torch.int32),
        block_tables=meta.block_tables.repeat(num_q, 1), max_query_len=1,  # type: ignore[attr-defined]
    )  # fmt: skip


def test_which_shapes_take_amx() -> None:
    """The shapes kv_bf16_dots takes (head_dim a multiple of 32 up to 256, an even block size, at
    most 128 query heads), in the AMX build only: never in the build without AMX or in the
    portable one."""
    assert AMX is not None and AMX.linear_bf16_amx
    takes = AMX.kv_amx_for
    assert [bool(takes(h, d, b)) for h, d, b in [(9, 64, 16), (32, 128, 16), (128, 256, 2), (9, 32, 4)]] == [True] * 4
    assert [bool(takes(h, d, b)) for h, d, b in [(9, 48, 16), (9, 16, 16), (9, 288, 16), (9, 64, 1), (9, 64, 15),
                                                 (129, 64, 16)]] == [False] * 6  # fmt: skip
    assert DOTS is not None and not DOTS.linear_bf16_amx and not DOTS.kv_amx_for(9, 64, 16)
    portable = load_kernels(portable=True)
    assert portable is not None and not portable.kv_amx_for(9, 64, 16)


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("window", [0, 3, 4])
def test_the_arithmetic_on_exact_values(block_size: int, window: int) -> None:
    """Prefill rows (a 9-token prompt in one chunk) and decodes of every position: the formula's
    bits, as on the vdpbf16ps path."""
    batch, table = _exact_batch(9, 9, block_size, window)
    prefill = _backend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 1.0)
    decoded = _backend().forward(batch.query, batch.k_cache, batch.v_cache, _decodes_of(batch.meta, 9, 9), 1.0)
    for pos in range(9):
        expected = _expected_row(batch, table, pos, window)
        assert torch.equal(prefill[pos], expected), pos
        assert torch.equal(decoded[pos], expected), pos


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "block_size", "window"),
                         [(3, 64, 16, 0), (3, 64, 16, 20), (3, 64, 16, 21), (2, 128, 4, 0), (1, 32, 2, 7),
                          (16, 64, 16, 0), (4, 96, 8, 13), (5, 256, 32, 0), (3, 64, 32, 37)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 3])
def test_a_prefill_row_is_bitwise_the_decode_of_its_position(
    queries_per_kv: int, head_dim: int, block_size: int, window: int, threads: int
) -> None:
    """45 query rows as one prefill chunk after 15 cached keys, and as 45 decodes (row j seeing its
    own prefix, or its window of it): bitwise equal, within bf16 rounding of SDPA, and not the
    vdpbf16ps path's bits."""
    chunk = make_batch([45], [60], block_size=block_size, head_dim=head_dim, queries_per_kv=queries_per_kv,
                       num_kv_heads=2, cache_dtype=torch.bfloat16, seed=head_dim + window)  # fmt: skip
    meta = dataclasses.replace(chunk.meta, window=window or None)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        as_chunk = _backend().forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, scale)
        as_decodes = _backend().forward(chunk.query, chunk.k_cache, chunk.v_cache, _decodes_of(meta, 45, 60), scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(as_chunk[:45], as_decodes[:45])
    reference = TorchAttentionBackend().forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, scale)
    torch.testing.assert_close(as_chunk[:45], reference[:45], atol=1.5e-2, rtol=1e-2)
    dots = _backend(DOTS).forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, scale)
    assert not torch.equal(dots[:45], as_chunk[:45])


def test_a_decode_batch_of_mixed_lengths_is_each_sequence_alone() -> None:
    """Six sequences of 1-130 keys decoded together give each one's bits
    alone, on 1 or 3 threads."""
    lens = [1, 17, 33, 64, 130, 95]
    batch = make_batch([1] * len(lens), lens, block_size=16, head_dim=64, queries_per_kv=3, num_kv_heads=3,
                       cache_dtype=torch.bfloat16, seed=11)  # fmt: skip
    together = _backend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for i in range(len(lens)):
                one = dataclasses.replace(
                    batch.meta, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                    seq_lens=batch.meta.seq_lens[i : i + 1], block_tables=batch.meta.block_tables[i : i + 1],
                    max_query_len=1,
                )  # fmt: skip
                alone = _backend().forward(batch.query[i : i + 1].contiguous(), batch.k_cache, batch.v_cache, one,
                                           0.125)  # fmt: skip
                assert torch.equal(alone[0], together[i]), (threads, i)
    finally:
        torch.set_num_threads(before)
    reference = TorchAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(together[: len(lens)], reference[: len(lens)], atol=1.5e-2, rtol=1e-2)
