"""Sliding-window attention in every backend: the torch reference, the native decode and prefill
kernels (AVX-512 and portable builds), and the Triton kernel (``TRITON_INTERPRET=1``, tiny shapes).

Each against ``paged_attention_ref`` with the window (transformers' rule: a query at ``p`` sees
keys ``p - window < j <= p``), and each again with every block wholly before the step's first
query's window replaced in the block tables, by the null block 0 or by a block of NaN: the output
must not change (bitwise), which it would if any such block were read, since one NaN value read
in K or V turns the row NaN even where the mask hides it afterwards.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.model_runner.attention.base import AttentionBackend
from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.kernels.paged_attention import paged_attention, paged_attention_ref
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from shared.kv_layout import first_visible_key

from .test_paged_attention import Batch, make_batch, run_reference

# one step: decodes long past the window, prefill chunks after cached context and from 0, a
# decode shorter than the window, padding rows
QUERY_LENS = [1, 37, 1, 9, 20, 1]
SEQ_LENS = [90, 37, 130, 75, 100, 5]


def _backends() -> list[tuple[str, AttentionBackend]]:
    found: list[tuple[str, AttentionBackend]] = [("torch", TorchAttentionBackend())]
    for name, backend in (("native", CpuAttentionBackend()), ("portable", CpuAttentionBackend(portable=True)),
                          ("batch_invariant", CpuAttentionBackend(batch_invariant=True))):  # fmt: skip
        assert backend.native_kernels is not None, "the native kernels did not build on this machine"
        found.append((name, backend))
    return found


BACKENDS = _backends()


def _windowed(batch: Batch, window: int) -> Batch:
    return dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, window=window))


def _poisoned(batch: Batch, with_nan: bool) -> Batch:
    """``batch`` with every table entry before each sequence's first live block replaced: by 0, or
    by a new block whose K and V are NaN."""
    meta, bs = batch.meta, batch.k_cache.shape[1]
    assert meta.window is not None
    k_cache, v_cache, poison = batch.k_cache, batch.v_cache, 0
    if with_nan:
        nan = torch.full((1, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype)
        k_cache, v_cache, poison = torch.cat((k_cache, nan)), torch.cat((v_cache, nan)), k_cache.shape[0]
    tables = meta.block_tables.clone()
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    replaced = 0
    for s, seq_len in enumerate(lens):
        first = first_visible_key(seq_len - (starts[s + 1] - starts[s]), meta.window) // bs
        tables[s, :first] = poison
        replaced += first
    assert replaced > 0, "the batch has no block before a window"
    return dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache,
                               meta=dataclasses.replace(meta, block_tables=tables))  # fmt: skip


def _forward(backend: AttentionBackend, batch: Batch) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    return backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)


@pytest.mark.parametrize(("name", "backend"), BACKENDS, ids=[n for n, _ in BACKENDS])
@pytest.mark.parametrize(("window", "block_size", "head_dim", "queries_per_kv"),
                         [(16, 4, 64, 3), (33, 16, 32, 1), (64, 1, 128, 4), (7, 16, 40, 2)])  # fmt: skip
def test_window_matches_the_reference_and_reads_nothing_before_it(
    name: str, backend: AttentionBackend, window: int, block_size: int, head_dim: int, queries_per_kv: int
) -> None:
    batch = _windowed(make_batch(QUERY_LENS, SEQ_LENS, block_size=block_size, head_dim=head_dim,
                                 queries_per_kv=queries_per_kv, num_kv_heads=2, num_pad_tokens=2,
                                 seed=window + block_size), window)  # fmt: skip
    n = batch.num_real_tokens
    out = _forward(backend, batch)
    expected = paged_reference(batch)
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-6, rtol=1e-5)
    full = run_reference(batch)  # the window changes the answer (else this test would prove little)
    assert not torch.allclose(full[:n], expected[:n], atol=1e-3)
    for with_nan in (False, True):
        again = _forward(backend, _poisoned(batch, with_nan))
        assert torch.equal(again[:n], out[:n]), (name, with_nan)


def paged_reference(batch: Batch) -> torch.Tensor:
    m = batch.meta
    return paged_attention_ref(batch.query, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens,
                               m.block_tables, batch.query.shape[-1] ** -0.5, window=m.window)  # fmt: skip


def test_window_wider_than_every_context_is_full_attention() -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, block_size=4, head_dim=64, num_kv_heads=2, seed=3)
    for _, backend in BACKENDS:
        assert torch.equal(_forward(backend, _windowed(batch, 200)), _forward(backend, batch))


@pytest.mark.parametrize(("window", "block_size", "queries_per_kv"), [(16, 4, 3), (5, 16, 1), (40, 1, 16)])
@pytest.mark.parametrize("variant", ["native", "portable", "plain"])
def test_a_windowed_prefill_row_is_bitwise_the_decode_of_its_position(
    window: int, block_size: int, queries_per_kv: int, variant: str
) -> None:
    """As the full-attention test of ``test_native_prefill_attention.py``: the 45 rows of one
    chunk (after 15 cached tokens) and the same rows as 45 decodes, bitwise equal."""
    chunk = _windowed(make_batch([45], [60], block_size=block_size, head_dim=64, queries_per_kv=queries_per_kv,
                                 num_kv_heads=2, seed=window), window)  # fmt: skip
    backend = CpuAttentionBackend(portable=variant == "portable", plain=variant == "plain")
    as_chunk = _forward(backend, chunk)
    meta = dataclasses.replace(
        chunk.meta, query_start_loc=torch.arange(46, dtype=torch.int32),
        seq_lens=torch.arange(16, 61, dtype=torch.int32), block_tables=chunk.meta.block_tables.repeat(45, 1),
        max_query_len=1,
    )  # fmt: skip
    as_decodes = backend.forward(chunk.query, chunk.k_cache, chunk.v_cache, meta, 64**-0.5)
    assert torch.equal(as_chunk[:45], as_decodes[:45])


@pytest.mark.parametrize(("window", "block_size", "tile_n"), [(16, 4, 16), (20, 16, 32)])
def test_triton_window(window: int, block_size: int, tile_n: int) -> None:
    """The Triton kernel under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
    batch = _windowed(make_batch([1, 23, 1, 6], [50, 23, 70, 40], block_size=block_size, head_dim=16,
                                 queries_per_kv=2, num_kv_heads=1, num_pad_tokens=1, seed=window), window)  # fmt: skip
    n = batch.num_real_tokens
    expected = paged_reference(batch)

    def run(b: Batch) -> torch.Tensor:
        m = b.meta
        return paged_attention(b.query, b.k_cache, b.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                               m.max_query_len, 16**-0.5, window=m.window, tile_n=tile_n)  # fmt: skip

    out = run(batch)
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-4, rtol=1e-4)
    for with_nan in (False, True):
        assert torch.equal(run(_poisoned(batch, with_nan))[:n], out[:n]), with_nan


def test_fp8_cache_window_in_the_torch_path() -> None:
    """An fp8 cache (dequantized on gather; the native kernels take fp32 only) under a window."""
    batch = _windowed(make_batch(QUERY_LENS, SEQ_LENS, block_size=4, head_dim=32, num_kv_heads=2,
                                 cache_dtype=torch.float8_e4m3fn, seed=11), 16)  # fmt: skip
    n = batch.num_real_tokens
    scale = batch.query.shape[-1] ** -0.5
    backend = TorchAttentionBackend()
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, batch.k_scale, batch.v_scale)
    m = batch.meta
    expected = paged_attention_ref(batch.query, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens,
                                   m.block_tables, scale, batch.k_scale, batch.v_scale, window=16)  # fmt: skip
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-5, rtol=1e-5)
    zeroed = _poisoned(batch, with_nan=False)
    again = backend.forward(zeroed.query, zeroed.k_cache, zeroed.v_cache, zeroed.meta, scale, batch.k_scale,
                            batch.v_scale)  # fmt: skip
    assert torch.equal(again[:n], out[:n])
