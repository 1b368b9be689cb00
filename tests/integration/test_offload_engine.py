"""Offload end to end over the real cores: a prefix evicted from the pool comes back from the
offload-store (DRAM or disk) and the answer does not change; faults turn into recomputation.

The engine, kv-cache-manager, model-runner and offload-store cores run in one process here (the
store maps the runner's pool through its /dev/shm handle, as the service does); the gRPC path of
the same flow is covered by tests/integration/test_suite_offload.py.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, text

from services.model_runner.config import RunnerConfig
from services.offload_store.config import OffloadConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.types import Final
from shared.hashing import hash_blocks
from shared.sampling_params import SamplingParams

BLOCK = 4
POOL_BLOCKS = 30  # 29 usable: one 41-token prompt plus a 100-token filler cannot both stay cached
BYTES_PER_BLOCK = 2048  # tiny Llama: 2 layers * 2 * 4 tokens * 2 kv heads * 16 dim * 4 bytes


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(1, 41)  # 10 full blocks; the cap (num_tokens - 1) allows all 10 to hit


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, postgres_url: str | None, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if request.param == "sqlite":
        yield "", "offload_blocks"
        return
    if postgres_url is None:
        pytest.skip("no PostgreSQL server answers at 127.0.0.1:5432 (users postgres, root)")
    table = f"offload_e2e_{uuid.uuid4().hex[:10]}"
    yield postgres_url, table
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP TABLE IF EXISTS "{table}"'))
    engine.dispose()


def _suite(model_dir: Path, data_dir: Path, db: tuple[str, str], dram_bytes: int,
           preemption: str = "recompute", pool_blocks: int = POOL_BLOCKS) -> InProcessSuite:
    # float32 pinned (the backend stays the default): cold and warm must agree bitwise, which
    # only fp32 is shown to do (docs/model_runner.md, "auto"); bf16 would be the default on AMX.
    rc = RunnerConfig(model_dir=str(model_dir), block_size=BLOCK, warmup=False, dtype="float32",
                      kv_cache_memory_bytes=pool_blocks * BYTES_PER_BLOCK)
    sc = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, preemption_mode=preemption)
    oc = OffloadConfig(data_dir=str(data_dir), db_url=db[0], db_table=db[1], dram_bytes=dram_bytes,
                       disk_bytes=64 << 20)
    return build_inprocess(rc, sc, with_tokenizer=False, offload_config=oc)


def _generate(suite: InProcessSuite, prompt: list[int], salt: str = "", max_tokens: int = 4) -> tuple[list[int], Final]:
    spec = build_spec(suite.engine, prompt, SamplingParams(ignore_eos=True), max_tokens, cache_salt=salt)
    chunks = list(OutputStream(suite.engine, spec, None))
    final = chunks[-1].final
    assert final is not None and final.metrics is not None
    return [t for c in chunks for t in c.token_ids], final


def _evict_from_pool(suite: InProcessSuite, salt: str = "") -> None:
    """Two unrelated 100-token requests push every block of PROMPT out of the pool."""
    for seed in (101, 102):
        _generate(suite, _prompt(seed, 100), max_tokens=2)
    hashes = hash_blocks(suite.engine.scheduler.hash_seed, PROMPT, BLOCK, salt.encode())
    assert suite.manager.lookup_prefix(hashes).num_cached_tokens == 0


def _block_file(suite: InProcessSuite, data_dir: Path, index: int, salt: str = "") -> Path:
    h = hash_blocks(suite.engine.scheduler.hash_seed, PROMPT, BLOCK, salt.encode())[index]
    matches = list((data_dir / "blocks").rglob(f"{h.hex()}*"))
    assert len(matches) == 1, matches
    return matches[0]


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_evicted_prefix_reloads_token_identical(tiny_llama_dir: Path, tmp_path: Path, db_url: tuple[str, str],
                                                tier: str) -> None:
    suite = _suite(tiny_llama_dir, tmp_path / "offload", db_url, dram_bytes=(1 << 20) if tier == "dram" else 0)
    try:
        cold, cold_final = _generate(suite, PROMPT)
        assert cold_final.metrics is not None and cold_final.metrics.cached_tokens == 0
        _evict_from_pool(suite)
        warm, warm_final = _generate(suite, PROMPT)
        assert warm == cold
        assert warm_final.metrics is not None and warm_final.metrics.cached_tokens == 40  # 10 blocks reloaded
        stats = suite.store.stats() if suite.store else None
        assert stats is not None
        if tier == "dram":
            assert stats.dram_hits == 10 and stats.disk_hits == 0
        else:
            assert stats.disk_hits == 10 and stats.dram_hits == 0
        offload = suite.engine.offload
        assert offload is not None and offload.counters.loaded_blocks == 10
        suite.manager.check_integrity()
    finally:
        suite.close()


@pytest.mark.parametrize("fault", ["corrupted", "truncated"])
def test_bad_block_file_is_recomputed(tiny_llama_dir: Path, tmp_path: Path, fault: str) -> None:
    data = tmp_path / "offload"
    suite = _suite(tiny_llama_dir, data, ("", "offload_blocks"), dram_bytes=0)
    try:
        cold, _ = _generate(suite, PROMPT)
        _evict_from_pool(suite)
        path = _block_file(suite, data, 4)
        raw = bytearray(path.read_bytes())
        if fault == "corrupted":
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
        else:
            path.write_bytes(bytes(raw[: len(raw) // 3]))
        warm, final = _generate(suite, PROMPT)
        assert warm == cold
        assert final.metrics is not None and final.metrics.cached_tokens == 16  # blocks 0-3 loaded, 4-9 recomputed
        assert suite.store is not None and suite.store.stats().corruptions == 1
        offload = suite.engine.offload
        assert offload is not None and offload.counters.load_failures == 6
        suite.manager.check_integrity()
    finally:
        suite.close()


def test_tenants_never_load_each_others_blocks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    suite = _suite(tiny_llama_dir, tmp_path / "offload", ("", "offload_blocks"), dram_bytes=1 << 20)
    try:
        cold, _ = _generate(suite, PROMPT, salt="tenant-a")
        _evict_from_pool(suite, salt="tenant-a")
        other, final = _generate(suite, PROMPT, salt="tenant-b")
        assert other == cold
        assert final.metrics is not None and final.metrics.cached_tokens == 0
        assert suite.store is not None and suite.store.stats().dram_hits == 0
        again, final = _generate(suite, PROMPT, salt="tenant-a")
        assert final.metrics is not None and final.metrics.cached_tokens > 0 and again == cold
    finally:
        suite.close()


def _concurrent(suite: InProcessSuite, prompts: list[list[int]]) -> list[list[int]]:
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        out[i] = _generate(suite, prompts[i], salt=f"s{i}", max_tokens=12)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [out[i] for i in range(len(prompts))]


def test_swap_preemption_matches_recompute(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = [_prompt(200 + i, 30 + 3 * i) for i in range(6)]
    results = {}
    for mode in ("recompute", "swap"):
        suite = _suite(tiny_llama_dir, tmp_path / mode, ("", "offload_blocks"), dram_bytes=1 << 20,
                       preemption=mode, pool_blocks=40)
        try:
            results[mode] = _concurrent(suite, prompts)
            assert suite.engine.scheduler.num_preemptions > 0
            if mode == "swap":
                offload = suite.engine.offload
                assert offload is not None and offload.counters.saved_blocks > 0
            suite.manager.check_integrity()
        finally:
            suite.close()
    assert results["swap"] == results["recompute"]
