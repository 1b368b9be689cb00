"""The shared remote tier end to end: two engines (two replicas: own pool, kv-cache-manager,
DRAM, disk and index each) share one Redis (the real one at 127.0.0.1:6379, own key prefix).

Replica B serves a prefix that replica A computed, from the remote tier, token-identical to a
cold run; a corrupted remote value is a miss; tenant A's blocks are never served to tenant B; a
dead Redis means recomputation with the same answer and a counted error. The cores run in one
process (the store maps the runner's pool through /dev/shm, as the service does).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from services.model_runner.config import RunnerConfig
from services.offload_store.config import OffloadConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.stream import Final, OutputStream, build_spec
from shared.hashing import hash_blocks
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.redis

BLOCK = 4
POOL_BLOCKS = 30  # 29 usable: one 41-token prompt plus a 100-token filler cannot both stay cached
BYTES_PER_BLOCK = 2048  # tiny Llama: 2 layers * 2 * 4 tokens * 2 kv heads * 16 dim * 4 bytes


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(1, 41)  # 10 full blocks; the cap (num_tokens - 1) allows all 10 to hit
Replica = Callable[..., InProcessSuite]


@pytest.fixture
def replica(tiny_llama_dir: Path, tmp_path: Path, redis_url: str, remote_prefix: str) -> Iterator[Replica]:
    """Builds replicas sharing the test's remote prefix (closed at teardown)."""
    suites: list[InProcessSuite] = []

    def make(name: str, url: str = redis_url, dram_bytes: int = 1 << 20) -> InProcessSuite:
        # float32 pinned: cold and warm runs must agree bitwise (see test_offload_engine.py)
        rc = RunnerConfig(model_dir=str(tiny_llama_dir), block_size=BLOCK, warmup=False, dtype="float32",
                          kv_cache_memory_bytes=POOL_BLOCKS * BYTES_PER_BLOCK)
        sc = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
        oc = OffloadConfig(data_dir=str(tmp_path / name), dram_bytes=dram_bytes, disk_bytes=64 << 20,
                           remote_url=url, remote_key_prefix=remote_prefix)
        suite = build_inprocess(rc, sc, with_tokenizer=False, offload_config=oc)
        suites.append(suite)
        return suite

    yield make
    for suite in suites:
        suite.close()


def _generate(suite: InProcessSuite, prompt: list[int], salt: str = "", max_tokens: int = 4) -> tuple[list[int], int]:
    spec = build_spec(suite.engine, prompt, SamplingParams(ignore_eos=True), max_tokens, cache_salt=salt)
    chunks = list(OutputStream(suite.engine, spec, None))
    final: Final | None = chunks[-1].final
    assert final is not None and final.metrics is not None
    return [t for c in chunks for t in c.token_ids], final.metrics.cached_tokens


def _compute_and_offload(suite: InProcessSuite, salt: str = "") -> list[int]:
    """Runs PROMPT cold, then two unrelated requests push its blocks out of the pool, which saves
    them to the store (and so to the remote tier)."""
    cold, cached = _generate(suite, PROMPT, salt)
    assert cached == 0
    for seed in (101, 102):
        _generate(suite, _prompt(seed, 100), max_tokens=2)
    sched = suite.engine.scheduler  # the hashes' one owner
    hashes = hash_blocks(sched.hash_seed, PROMPT, sched.block_size, salt.encode())
    assert suite.manager.lookup_prefix(hashes).num_cached_tokens == 0
    return cold


def _closed_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


def test_replica_b_serves_what_replica_a_computed(replica: Replica) -> None:
    a = replica("a")
    cold = _compute_and_offload(a)
    assert a.store is not None and a.store.core.remote is not None and a.store.core.remote.stats.saves >= 10
    b = replica("b")
    warm, cached = _generate(b, PROMPT)
    assert warm == cold
    assert cached == 40  # 10 blocks from the remote tier, only the last token computed
    assert b.store is not None and b.store.core.remote is not None
    assert b.store.core.remote.stats.hits == 10 and b.store.core.remote.stats.errors == 0
    s = b.store.stats()
    assert (s.dram_hits, s.disk_hits, s.misses) == (0, 0, 0)
    assert b.engine.offload is not None and b.engine.offload.counters.loaded_blocks == 10
    b.manager.check_integrity()


def test_corrupted_remote_value_is_recomputed(replica: Replica, redis_url: str) -> None:
    a = replica("a")
    cold = _compute_and_offload(a)
    assert a.store is not None and a.store.core.remote is not None
    h = hash_blocks(a.engine.scheduler.hash_seed, PROMPT, BLOCK, b"")[4]
    raw = redis.Redis.from_url(redis_url)
    key = a.store.core.remote.key(h)
    value = bytearray(raw.get(key) or b"")
    assert value, "block 4 was not written to the remote tier"
    value[len(value) // 2] ^= 0xFF
    raw.set(key, bytes(value))
    raw.close()
    b = replica("b")
    warm, cached = _generate(b, PROMPT)
    assert warm == cold
    assert cached == 16  # blocks 0-3 loaded, 4-9 recomputed
    assert b.store is not None and b.store.core.remote is not None
    assert (b.store.core.remote.stats.hits, b.store.core.remote.stats.corruptions) == (4, 1)
    assert b.engine.offload is not None and b.engine.offload.counters.load_failures == 6


def test_tenants_never_share_remote_blocks(replica: Replica) -> None:
    a = replica("a")
    cold = _compute_and_offload(a, salt="tenant-a")
    b = replica("b")
    other, cached = _generate(b, PROMPT, salt="tenant-b")
    assert other == cold and cached == 0  # other salt, other keys: nothing to find
    assert b.store is not None and b.store.core.remote is not None
    assert b.store.core.remote.stats.hits == 0
    same, cached = _generate(b, PROMPT, salt="tenant-a")
    assert same == cold and cached == 40
    assert b.store.core.remote.stats.hits == 10


def test_dead_redis_means_recompute_same_answer(replica: Replica) -> None:
    a = replica("a")
    cold = _compute_and_offload(a)
    b = replica("b", url=f"redis://127.0.0.1:{_closed_port()}/0")
    warm, cached = _generate(b, PROMPT)
    assert warm == cold and cached == 0
    assert b.store is not None and b.store.core.remote is not None
    assert b.store.core.remote.stats.errors == 1 and b.store.core.remote.last_error == "ConnectionError"
    assert b.engine.offload is not None and b.engine.offload.counters.errors == 0  # no call failed
