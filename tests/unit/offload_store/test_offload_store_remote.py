"""The store core with its remote tier: two stores (own DRAM, disk and index each) share one Redis.

What one store saves, the other finds (lookup) and loads bitwise into its own pool, promoting it
to DRAM; a corrupt remote value stops the load there and leaves the pool block untouched; a dead
Redis turns into misses and counted errors while the local tiers keep working.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from offload_testlib import SHM_DIR, PoolFactory
from prometheus_client import CollectorRegistry, generate_latest

from services.offload_store.config import OffloadConfig
from services.offload_store.remote_metrics import RemoteTierCollector
from services.offload_store.store import OffloadStore
from shared.config import from_env
from shared.hashing import BlockHash

pytestmark = pytest.mark.redis
NBYTES = 1024  # one block of the default test pool


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


Store = Callable[..., OffloadStore]


@pytest.fixture
def make_store(tmp_path: Path, redis_url: str, remote_prefix: str) -> Iterator[Store]:
    """Stores with their own data dir (SQLite index) and the test's remote prefix."""
    stores: list[OffloadStore] = []

    def make(name: str, dram_blocks: int = 4, disk_blocks: int = 8, url: str = redis_url) -> OffloadStore:
        config = OffloadConfig(data_dir=str(tmp_path / name), dram_bytes=dram_blocks * NBYTES,
                               disk_bytes=disk_blocks * NBYTES, pool_dir=SHM_DIR, remote_url=url,
                               remote_key_prefix=remote_prefix)
        store = OffloadStore(config)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_config_from_env() -> None:
    env = {"KVMESH_OFFLOAD_REMOTE_URL": "redis://r:6379/1", "KVMESH_OFFLOAD_REMOTE_TIMEOUT_SECONDS": "0.05",
           "KVMESH_OFFLOAD_REMOTE_KEY_PREFIX": "prod:", "KVMESH_OFFLOAD_REMOTE_TTL_SECONDS": "3600"}
    c = from_env(OffloadConfig, "KVMESH_OFFLOAD_", env)
    assert (c.remote_url, c.remote_timeout_seconds, c.remote_key_prefix, c.remote_ttl_seconds) == (
        "redis://r:6379/1", 0.05, "prod:", 3600)
    assert OffloadConfig().remote_url == ""  # off by default
    with pytest.raises(ValueError):
        OffloadConfig(remote_timeout_seconds=0)


@pytest.mark.parametrize("dram_blocks", [4, 0])
def test_other_store_loads_what_one_saved(make_store: Store, make_pool: PoolFactory, dram_blocks: int) -> None:
    a, b = make_store("a", dram_blocks=dram_blocks), make_store("b", dram_blocks=dram_blocks)
    pool_a, pool_b = make_pool(), make_pool()
    a.attach_pool(pool_a.handle)
    b.attach_pool(pool_b.handle)
    data = [pool_a.fill_random(i, seed=i) for i in range(1, 4)]
    assert a.save([(_hash(i), i) for i in range(1, 4)]).num_saved == 3
    assert a.remote is not None and a.remote.stats.saves == 3
    assert b.lookup([_hash(1), _hash(2), _hash(3), _hash(9)]) == (3, 0)
    result = b.load([(_hash(1), 5), (_hash(2), 6), (_hash(3), 7)])
    assert result.num_loaded == 3 and result.failed_hashes == []
    for i, block in zip(range(3), (5, 6, 7), strict=True):
        assert pool_b.block_bytes(block).equal(data[i])
    assert b.remote is not None and (b.remote.stats.hits, b.remote.stats.bytes_read) == (3, 3 * NBYTES)
    s = b.stats()
    assert (s.dram_hits, s.disk_hits, s.misses, s.dram_blocks) == (0, 0, 0, 3 if dram_blocks else 0)
    if dram_blocks:  # promoted: the next load is local
        assert b.lookup([_hash(1), _hash(2), _hash(3)]) == (3, 3)
        assert b.load([(_hash(1), 1)]).num_loaded == 1 and b.stats().dram_hits == 1
        assert b.remote.stats.hits == 3


def test_local_blocks_first_then_remote(make_store: Store, make_pool: PoolFactory) -> None:
    a, b = make_store("a"), make_store("b")
    pool_a, pool_b = make_pool(), make_pool()
    a.attach_pool(pool_a.handle)
    b.attach_pool(pool_b.handle)
    for i in (1, 2, 3):
        pool_a.fill_random(i, seed=i)
    a.save([(_hash(i), i) for i in (1, 2, 3)])
    pool_b.fill_random(1, seed=1)
    b.save([(_hash(1), 1)])  # B holds block 1 itself (and finds it remote already: not re-sent)
    assert b.remote is not None and b.remote.stats.skipped_saves == 1 and b.remote.stats.saves == 0
    assert b.load([(_hash(1), 4), (_hash(2), 5), (_hash(3), 6)]).num_loaded == 3
    assert b.stats().dram_hits == 1 and b.remote.stats.hits == 2
    assert pool_b.block_bytes(6).equal(pool_a.block_bytes(3))


def test_corrupt_remote_value_stops_the_load(make_store: Store, make_pool: PoolFactory, redis_url: str) -> None:
    a, b = make_store("a"), make_store("b")
    pool_a, pool_b = make_pool(), make_pool()
    a.attach_pool(pool_a.handle)
    b.attach_pool(pool_b.handle)
    for i in (1, 2, 3):
        pool_a.fill_random(i, seed=i)
    a.save([(_hash(i), i) for i in (1, 2, 3)])
    assert a.remote is not None and b.remote is not None
    key = a.remote.key(BlockHash(_hash(2)))
    raw = redis.Redis.from_url(redis_url)
    value = bytearray(raw.get(key) or b"")
    value[-1] ^= 0xFF  # flip a byte of the payload
    raw.set(key, bytes(value))
    before = pool_b.fill_random(6, seed=66)
    result = b.load([(_hash(1), 5), (_hash(2), 6), (_hash(3), 7)])
    assert result.num_loaded == 1 and result.failed_hashes == [_hash(2)]
    assert pool_b.block_bytes(6).equal(before)  # verified before it reached the pool
    assert (b.remote.stats.corruptions, b.stats().misses) == (1, 1)
    assert raw.exists(key) == 0
    raw.close()


def test_other_pool_format_is_not_offered(make_store: Store, make_pool: PoolFactory) -> None:
    a, b = make_store("a"), make_store("b")
    pool_a, pool_b = make_pool(), make_pool(dtype="float16", head_dim=16)  # same bytes per block
    a.attach_pool(pool_a.handle)
    pool_a.fill_random(1, seed=1)
    a.save([(_hash(1), 1)])
    assert b.lookup([_hash(1)]) == (1, 0)  # no pool yet: any format counts
    b.attach_pool(pool_b.handle)
    assert b.lookup([_hash(1)]) == (0, 0)
    assert b.load([(_hash(1), 1)]).num_loaded == 0
    assert b.remote is not None and b.remote.stats.mismatches == 1


def test_dead_redis_is_a_miss_and_local_tiers_work(make_store: Store, make_pool: PoolFactory) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    a = make_store("a", url=f"redis://127.0.0.1:{port}/0")
    pool = make_pool()
    a.attach_pool(pool.handle)
    data = pool.fill_random(1, seed=1)
    assert a.save([(_hash(1), 1)]).num_saved == 1  # DRAM took it, Redis did not
    assert a.lookup([_hash(1), _hash(2)]) == (1, 1)
    assert a.load([(_hash(1), 3)]).num_loaded == 1 and pool.block_bytes(3).equal(data)
    assert a.remote is not None and a.remote.stats.errors == 1  # then bypassed, not retried per call
    assert a.remote.stats.bypassed == 1 and a.remote.stats.saves == 0


def test_metrics_are_read_from_the_tier(make_store: Store, make_pool: PoolFactory) -> None:
    a = make_store("a")
    pool = make_pool()
    a.attach_pool(pool.handle)
    pool.fill_random(1, seed=1)
    a.save([(_hash(1), 1)])
    assert a.remote is not None
    registry = CollectorRegistry()
    registry.register(RemoteTierCollector(a.remote, "m"))
    text = generate_latest(registry).decode()
    assert 'kvmesh:offload_remote_saves_total{model_name="m"} 1.0' in text
    assert 'kvmesh:offload_remote_errors_total{model_name="m"} 0.0' in text
    assert 'kvmesh:offload_remote_round_trips_total{model_name="m"} 2.0' in text
    assert 'kvmesh:offload_remote_up{model_name="m"} 1.0' in text
