"""The INT4 KV cache: its format (``attention/int4.py``), its pool sizing, and a runner serving on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.model_runner.attention.int4 import dequantize_int4, hadamard, int4_head_dim, quantize_int4, rotate_groups
from services.model_runner.config import RunnerConfig
from services.model_runner.kv_pool import KVPool, bytes_per_block, kv_dtype_for
from shared.errors import InvalidArgument
from shared.kv_layout import gqa_kv_bytes_per_token, int4_group_size, int4_row_bytes


def test_known_row_packs_to_known_bytes() -> None:
    """amax 7 -> scale 1.0 (float16 0x3C00); ties round to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2)."""
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 2.0, 3.0, -3.0, 4.0, 5.0, 6.0, -6.0, 0.5, 1.5, -0.5, 2.5])
    packed = quantize_int4(x)
    # nibbles q + 8: 15 1 | 9 7 | 8 10 | 11 5 | 12 13 | 14 2 | 8 10 | 8 10 (low nibble first)
    assert packed.tolist() == [0x1F, 0x79, 0xA8, 0x5B, 0xDC, 0x2E, 0xA8, 0xA8, 0x00, 0x3C]
    assert dequantize_int4(packed).tolist() == [7, -7, 1, -1, 0, 2, 3, -3, 4, 5, 6, -6, 0, 2, 0, 2]


def test_zero_group_and_two_groups() -> None:
    """head_dim 64: two groups of 32, each with its own scale; an all-zero group has scale 0."""
    x = torch.zeros(64)
    x[40] = -14.0  # group 1: amax 14 -> scale 2.0 (float16 0x4000)
    packed = quantize_int4(x)
    assert packed.shape == (36,)
    assert packed[:16].tolist() == [0x88] * 16  # group 0: every nibble 8
    assert packed[20].item() == 0x81  # channels 40 (q -7 -> nibble 1) and 41 (nibble 8)
    assert packed[32:].tolist() == [0x00, 0x00, 0x00, 0x40]
    assert torch.equal(dequantize_int4(packed), x)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_round_trip_error_is_half_a_step(head_dim: int) -> None:
    """|x - dequant(quant(x))| <= scale / 2 per group, plus the float16 rounding of the scale
    (amax / scale can reach 7 (1 + 2^-11), clamped to 7)."""
    x = torch.randn(50, 3, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 5
    group = int4_group_size(head_dim)
    scale = (x.view(50, 3, -1, group).abs().amax(-1) / 7).to(torch.float16).float()  # [50, 3, groups]
    error = (dequantize_int4(quantize_int4(x)) - x).abs().view(50, 3, -1, group)
    assert (error <= (scale * (0.5 + 7 * 2**-10)).unsqueeze(-1)).all()
    assert error.max() > 0.4 * scale.min()  # it is a 4-bit grid, not a near-exact one


def test_row_sizes_and_their_inverse() -> None:
    assert [int4_row_bytes(d) for d in (8, 16, 32, 64, 96, 128, 256)] == [6, 10, 18, 36, 54, 72, 144]
    assert [int4_group_size(d) for d in (8, 16, 32, 64, 128)] == [8, 16, 32, 32, 32]
    for d in (8, 16, 32, 64, 96, 128, 256):
        assert int4_head_dim(int4_row_bytes(d)) == d
    with pytest.raises(ValueError, match="no INT4 row"):
        int4_head_dim(11)
    with pytest.raises(ValueError, match="INT4 KV needs"):
        int4_group_size(48)


def test_hadamard_is_orthonormal_and_keeps_dot_products() -> None:
    h = hadamard(32)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(32), atol=1e-6, rtol=0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 64, generator=gen), torch.randn(7, 64, generator=gen)
    torch.testing.assert_close(rotate_groups(q, h) @ rotate_groups(k, h).T, q @ k.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_groups(rotate_groups(q, h), h), q, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)


def test_hadamard_spreads_an_outlier_channel() -> None:
    """One channel 30x the others: unrotated, its scale rounds the other 31 to 0 or +-1 steps; rotated,
    the outlier's energy is spread and the rest keep their precision (K's error, as q.k sees it)."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(200, 32, generator=gen)
    k[:, 3] = 30.0
    h = hadamard(32)
    plain = (dequantize_int4(quantize_int4(k)) - k).pow(2).sum().item()
    rotated = (rotate_groups(dequantize_int4(quantize_int4(rotate_groups(k, h))), h) - k).pow(2).sum().item()
    assert rotated < plain / 4


def test_pool_block_counts_for_a_budget() -> None:
    """SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, blocks of 16) in 512 MiB: 36 bytes a
    row against fp16's 128 and fp32's 256, i.e. 3.56x fp16's blocks and 7.11x fp32's."""
    budget = 512 << 20
    per_block = {name: bytes_per_block(30, 16, 3, 64, kv_dtype_for(name, torch.float32))
                 for name in ("float32", "float16", "fp8_e4m3", "int4")}  # fmt: skip
    assert per_block == {"float32": 737280, "float16": 368640, "fp8_e4m3": 184320, "int4": 103680}
    assert {name: budget // b for name, b in per_block.items()} == {
        "float32": 728, "float16": 1456, "fp8_e4m3": 2912, "int4": 5178}
    assert per_block["int4"] == 16 * gqa_kv_bytes_per_token(30, 3, 64, int4_row_bytes(64) / 64)


def test_int4_pool_is_bytes_with_their_scales() -> None:
    per_block = 2 * 2 * 4 * 2 * 36  # layers x (K, V) x block_size x kv_heads x row bytes
    with KVPool(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, memory_bytes=10 * per_block + per_block - 1,
                dtype=kv_dtype_for("int4", torch.float32), hadamard=True) as pool:  # fmt: skip
        assert pool.num_blocks == 10 and pool.bytes_per_block == per_block == 1152
        assert pool.tensor.dtype == torch.uint8 and tuple(pool.tensor.shape) == (2, 2, 10, 4, 2, 36)
        assert pool.kv_cache_dtype == "int4" and pool.is_int4 and not pool.is_fp8
        assert pool.rotation is not None and torch.equal(pool.rotation, hadamard(32))
        handle = pool.handle()
        assert handle.dtype == "uint8" and handle.nbytes == 10 * per_block


def test_hadamard_needs_int4() -> None:
    with pytest.raises(InvalidArgument, match="int4 KV cache only"):
        KVPool(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4, memory_bytes=1 << 16, dtype=torch.float32,
               hadamard=True)  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache_hadamard needs kv_cache_dtype int4"):
        RunnerConfig(kv_cache_hadamard=True)
    with pytest.raises(ValueError, match="one of auto, float32, bfloat16, fp8_e4m3, int4"):
        RunnerConfig(kv_cache_dtype="int8")
    assert RunnerConfig(kv_cache_dtype="int4", kv_cache_hadamard=True).kv_cache_hadamard


PROMPT = [(7 * i + 3) % 300 + 2 for i in range(15)]


@pytest.mark.parametrize(("backend", "rotate"), [("torch", False), ("torch", True), ("cpu", False), ("cpu", True)])
def test_prefix_hits_give_a_cold_runs_tokens(
    backend: str, rotate: bool, checkpoint: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any
) -> None:
    """In INT4 mode a request reading a donor's cached blocks (chunked prefill of 6) samples what it
    samples alone on a fresh pool: the blocks hold the same bytes however they were written."""
    folder = checkpoint("llama")
    warm = make_runner(folder, num_blocks=96, kv_cache_dtype="int4", backend=backend, hadamard=rotate)
    assert warm.model_info().kv_cache_dtype == "int4"
    sched = mini_scheduler(warm, chunk=6)
    sched.add(sim_request("donor", [*PROMPT, 11, 12, 13], max_new_tokens=8))
    sched.add(sim_request("while", [*PROMPT, 21, 22], max_new_tokens=6, arrival_step=5, prefix_from="donor"))
    sched.add(sim_request("after", [*PROMPT[:8], 5], max_new_tokens=6, arrival_step=14, prefix_from="donor"))
    hot = sched.run()
    firsts = {r.request_id: r for s in sched.steps for r in s.new_requests}
    assert firsts["while"].num_computed_tokens == 12 and firsts["after"].num_computed_tokens == 8
    for rid, prompt in (("while", [*PROMPT, 21, 22]), ("after", [*PROMPT[:8], 5])):
        cold_sched = mini_scheduler(make_runner(folder, kv_cache_dtype="int4", backend=backend, hadamard=rotate))
        cold_sched.add(sim_request(rid, prompt, max_new_tokens=6))
        assert cold_sched.run()[rid] == hot[rid], rid


def test_build_runner_serves_int4_with_hadamard(checkpoint: Any) -> None:
    """What the service builds from ``KVMESH_RUNNER_KV_CACHE_DTYPE=int4`` + ``_KV_CACHE_HADAMARD=1``."""
    from services.model_runner.factory import build_runner

    folder = checkpoint("llama")
    budget = 40 * bytes_per_block(3, 4, 2, 16, torch.uint8)
    runner = build_runner(RunnerConfig(model_dir=str(folder), device="cpu", dtype="float32", attention_backend="cpu",
                                       block_size=4, kv_cache_memory_bytes=budget, kv_cache_dtype="int4",
                                       kv_cache_hadamard=True))  # fmt: skip
    try:
        info = runner.model_info()
        assert (info.kv_cache_dtype, info.num_blocks, info.bytes_per_block) == ("int4", 40, 3 * 2 * 4 * 2 * 10)
        assert runner.pool.rotation is not None and runner.pool.rotation.shape == (16, 16)
    finally:
        runner.pool.close()
