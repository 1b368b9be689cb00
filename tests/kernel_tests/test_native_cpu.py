"""The native CPU kernels (``services/model_runner/native/*.c``) against the torch reference.

Both builds are checked: the AVX-512 one this machine runs (when the CPU has AVX-512) and the
portable C loops a CPU without it runs. Cache contents are random everywhere, blocks shuffled,
so reading a wrong block or a slot past a sequence's length shows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch

from services.model_runner import native
from services.model_runner.attention import cpu_backend
from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.model.native_layers import NativeRMSNorm, NativeRotary, NativeSiluAndMul

from .test_paged_attention import make_batch

VARIANTS = ["native", "portable"]


@pytest.fixture(params=[*VARIANTS, "plain"])
def backend(request: pytest.FixtureRequest) -> CpuAttentionBackend:
    b = CpuAttentionBackend(portable=request.param == "portable", plain=request.param == "plain")
    assert b.native_kernels is not None, "the native kernels did not build on this machine"
    return b


def _forward(backend: TorchAttentionBackend, batch: object) -> torch.Tensor:
    b = batch  # a test_paged_attention.Batch
    scale = b.query.shape[-1] ** -0.5  # type: ignore[attr-defined]
    return backend.forward(b.query, b.k_cache, b.v_cache, b.meta, scale)  # type: ignore[attr-defined]


def _assert_matches_torch(backend: CpuAttentionBackend, batch: object) -> None:
    n = batch.num_real_tokens  # type: ignore[attr-defined]
    out = _forward(backend, batch)
    expected = _forward(TorchAttentionBackend(), batch)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("queries_per_kv", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 32, 40])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_decode_matches_the_torch_reference(
    backend: CpuAttentionBackend, block_size: int, head_dim: int, queries_per_kv: int
) -> None:
    """Head dims 64 and 128 take the specialised AVX-512 code, 32 the generic one, 40 (not a
    multiple of 16) the portable loops; lengths straddle 16-token chunks and block edges."""
    seq_lens = [1, 7, 16, 17, 33, 100]
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size=block_size, head_dim=head_dim,
                       queries_per_kv=queries_per_kv, num_kv_heads=2, seed=block_size * 7 + head_dim)  # fmt: skip
    _assert_matches_torch(backend, batch)


def test_mixed_batch_with_chunks_and_padding(backend: CpuAttentionBackend) -> None:
    """Decodes go to the kernel, prefill chunks to the torch path, in one call; padding rows past
    ``query_start_loc[-1]`` are not looked at."""
    batch = make_batch([6, 1, 13, 1, 2, 1], [6, 40, 21, 9, 34, 300], block_size=16, head_dim=64,
                       queries_per_kv=3, num_kv_heads=3, num_pad_tokens=4)  # fmt: skip
    _assert_matches_torch(backend, batch)


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_any_thread_count(backend: CpuAttentionBackend, threads: int) -> None:
    """Threads take sequences in pairs from both ends of a run; an odd count leaves one thread a
    run to itself: every sequence is attended to exactly once, whatever the count."""
    seq_lens = [5, 40, 17, 9, 33, 100, 2]
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size=16, head_dim=64, queries_per_kv=3,
                       num_kv_heads=3, seed=threads)  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_matches_torch(backend, batch)
    finally:
        torch.set_num_threads(before)


def test_long_context_and_large_softmax_range(backend: CpuAttentionBackend) -> None:
    """2,000 keys and scores spread over ~100 units: the exp range reduction and the max shift."""
    batch = make_batch([1, 1], [2000, 1999], block_size=16, head_dim=64, queries_per_kv=3, num_kv_heads=1)
    batch.query.mul_(8.0)
    _assert_matches_torch(backend, batch)


def test_query_rows_need_not_be_contiguous(backend: CpuAttentionBackend) -> None:
    """The model hands the backend q as a view of the fused qkv projection (a row stride > H * D)."""
    batch = make_batch([1, 1, 1], [5, 20, 37], head_dim=64, queries_per_kv=3, num_kv_heads=2)
    wide = torch.randn(3, batch.query.shape[1] + 4, 64)
    wide[:, : batch.query.shape[1]] = batch.query
    view = wide[:, : batch.query.shape[1]]
    assert not view.is_contiguous()
    out = backend.forward(view, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    expected = TorchAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_write_kv_stores_exactly_what_the_torch_path_stores(backend: CpuAttentionBackend) -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (9, 4, 2, 64)  # blocks, block_size, KV, D
    caches = [torch.randn(shape, generator=gen) for _ in range(4)]
    k_ours, v_ours, k_ref, v_ref = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    fused = torch.randn(5, 6, 64, generator=gen)  # as in the model: k and v are views of a wider row
    key, value = fused[:, 2:4], fused[:, 4:6]
    slots = torch.tensor([5, -1, 35, 0, 12], dtype=torch.long)  # -1: batch padding, never written
    backend.write_kv(key, value, k_ours, v_ours, slots)
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_ours, k_ref) and torch.equal(v_ours, v_ref)
    flat = k_ours.view(-1, 2, 64)
    assert torch.equal(flat[35], key[2]) and torch.equal(flat[0], key[3])


def test_other_dtypes_take_the_torch_path(backend: CpuAttentionBackend) -> None:
    batch = make_batch([1, 3], [9, 12], head_dim=64, dtype=torch.bfloat16)
    out = _forward(backend, batch)
    assert torch.equal(out[:4], _forward(TorchAttentionBackend(), batch)[:4])


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    native.load_kernels.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("KVMESH_NATIVE_CACHE", str(tmp_path))
    yield
    native.load_kernels.cache_clear()


def test_without_a_compiler_the_backend_falls_back_to_torch(
    no_compiler: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        backend = CpuAttentionBackend()
    assert backend.native_kernels is None
    assert "native CPU kernels unavailable" in caplog.text
    batch = make_batch([1, 4], [30, 4], head_dim=64)
    assert torch.equal(_forward(backend, batch)[:5], _forward(TorchAttentionBackend(), batch)[:5])


# ("-mno-avx512bf16",): an AVX-512 CPU without bf16 dot products (Skylake-X, Ice Lake), whose build leaves
# out the bf16 GEMMs and bf16 attention
@pytest.mark.parametrize("extra", [(), native.PORTABLE_CFLAGS, native.NO_AMX_CFLAGS, ("-mno-avx512bf16",)])
def test_sources_compile_without_warnings(extra: tuple[str, ...], tmp_path: object,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_NATIVE_CACHE", str(tmp_path))
    assert native.build(extra_cflags=(*extra, "-Werror")).exists()


def test_build_is_cached_by_content(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_NATIVE_CACHE", str(tmp_path))
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert native.build(extra_cflags=native.PORTABLE_CFLAGS) != first
    assert sorted(p.name for p in first.parent.iterdir() if p.name.startswith(".")) == []  # no temp files left


@pytest.mark.parametrize("window", [None, 32])
def test_a_decode_steps_plan_is_the_general_one(window: int | None) -> None:
    """A decode step's plan is built from the metadata's own arrays, without the general path's
    per-sequence passes; it must be that path's plan (which does not read ``max_query_len``)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 300, (37,), generator=gen).int()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(37, dtype=torch.int64), query_start_loc=torch.arange(38, dtype=torch.int32),
        seq_lens=lens, block_tables=torch.randint(0, 99, (37, 19), generator=gen, dtype=torch.int32),
        max_query_len=1, max_seq_len=int(lens.max()), window=window,
    )  # fmt: skip
    for per_row in (False, True):
        fast = cpu_backend._native_plan(meta, 16, per_row)
        general = cpu_backend._native_plan(dataclasses.replace(meta, max_query_len=2), 16, per_row)
        for name in ("rows", "seq_lens", "tables"):
            got, want = getattr(fast, name), getattr(general, name)
            assert got.dtype == want.dtype and got.is_contiguous() and torch.equal(got, want)
        assert (fast.max_len, fast.chunks, fast.chunk_tables, fast.window) == (
            general.max_len, general.chunks, general.chunk_tables, general.window)


def test_metadata_without_decodes_runs_no_kernel(backend: CpuAttentionBackend) -> None:
    batch = make_batch([5, 8], [5, 20], head_dim=64)
    _assert_matches_torch(backend, batch)
    meta: AttentionMetadata = batch.meta
    plan = backend._plan_native(meta, batch.k_cache.shape[1])
    assert plan.rows.numel() == 0 and [(c.start, c.end) for c in plan.chunks] == [(0, 5), (5, 13)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 32, 300])  # 300 x 576 takes the threaded branch
def test_add_rms_norm_matches_torch(variant: str, rows: int) -> None:
    from services.model_runner.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x = torch.randn(rows, 700, generator=gen)[:, :576]  # rows 700 apart, as a view of a wider output
    residual = torch.randn(rows, 576, generator=gen)
    expected_sum = residual + x
    expected = norm(expected_sum.clone())  # the torch path
    kernels = native.load_kernels(portable=variant == "portable")
    assert kernels is not None
    fused = NativeRMSNorm(norm, kernels)
    torch.testing.assert_close(fused(x), norm(x), atol=1e-6, rtol=1e-5)
    out, res = fused.add_forward(x, residual)
    assert res is residual and torch.equal(residual, expected_sum)  # the add is exact, in place
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 32, 700])
def test_rope_is_bitwise_the_torch_formula(variant: str, tokens: int) -> None:
    from services.model_runner.model.config import RopeConfig
    from services.model_runner.model.layers import RotaryEmbedding, apply_rotary

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin = rotary(positions, torch.float32)
    qkv = torch.randn(tokens, 15, 64)  # q and k heads are the first 12 of a fused projection
    qk = qkv[:, :12]
    kernels = native.load_kernels(portable=variant == "portable")
    assert kernels is not None
    assert torch.equal(NativeRotary(kernels)(qk, cos, sin), apply_rotary(qk, cos, sin))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 32, 200])
def test_swiglu_matches_torch(variant: str, tokens: int) -> None:
    """silu(gate) * up from the merged projection's halves (1,000 wide: a 16-lane tail), gates
    from -60 to 60, against torch elementwise; then the MLP end to end."""
    from services.model_runner.model.config import ModelConfig, RopeConfig
    from services.model_runner.model.layers import MLP

    gen = torch.Generator().manual_seed(tokens)
    gate_up = torch.randn(tokens, 2000, generator=gen) * 20
    kernels = native.load_kernels(portable=variant == "portable")
    assert kernels is not None
    act = torch.empty(tokens, 1000)
    kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), tokens, 1000)
    gate, up = gate_up.split(1000, dim=-1)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=2e-6)

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=1000,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5,
                      rope=RopeConfig(), max_position_embeddings=64)  # fmt: skip
    mlp = MLP(cfg)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data = torch.randn(linear.weight.shape, generator=gen) * 0.1
    x = torch.randn(tokens, 64, generator=gen)
    expected = mlp(x)
    mlp.act_fn = NativeSiluAndMul(kernels)
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)
