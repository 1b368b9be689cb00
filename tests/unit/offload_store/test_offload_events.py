"""The offload-store's tier events: a mirror built from snapshot + batches equals the real tiers.

Two stores (own DRAM 2 blocks, disk 3 blocks, SQLite index) share one real Redis under the
test's prefix. After every operation, the mirror (the first snapshot, then each published
batch applied in order, exactly as the router does) must equal the next snapshot and the
tiers' own contents: saves that spill DRAM to disk, disk evictions, a remote load that promotes
into DRAM, a remote value deleted behind the store's back (found missing on lookup), and a
store restart (a fresh hub: numbers start again, the snapshot holds the disk tier it reconciled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from offload_testlib import SHM_DIR, PoolFactory

from services.offload_store import convert
from services.offload_store.config import OffloadConfig
from services.offload_store.store import OffloadStore
from services.offload_store.types import TIERS, StoredBlocks
from shared.event_hub import Subscription
from shared.hashing import BlockHash

pytestmark = pytest.mark.redis
NBYTES = 1024  # one block of the default test pool


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


class Mirror:
    """What a subscriber knows: a snapshot, then every later batch (via the wire format)."""

    def __init__(self, store: OffloadStore) -> None:
        self.sub: Subscription = store.hub.subscribe()
        snap = store.stored_blocks()
        self.seq = snap.seq
        self.tiers = {t: set(snap.tier(t)) for t in TIERS}

    def drain(self) -> None:
        while (batch := self.sub.get(timeout=0)) is not None:
            batch = convert.event_batch_from_pb(convert.event_batch_to_pb(batch))
            if batch.seq <= self.seq:
                continue
            assert batch.seq == self.seq + 1  # no gap, in order
            self.seq = batch.seq
            for e in batch.events:
                (self.tiers[e.tier].update if e.stored else self.tiers[e.tier].difference_update)(e.block_hashes)

    def check(self, store: OffloadStore) -> StoredBlocks:
        self.drain()
        snap = convert.stored_blocks_from_pb(convert.stored_blocks_to_pb(store.stored_blocks()))
        assert snap.seq == self.seq
        assert {t: set(snap.tier(t)) for t in TIERS} == self.tiers
        return snap


Store = Callable[..., OffloadStore]


@pytest.fixture
def make_store(tmp_path: Path, redis_url: str, remote_prefix: str) -> Iterator[Store]:
    stores: list[OffloadStore] = []

    def make(name: str, remote_index_blocks: int = 1 << 10) -> OffloadStore:
        store = OffloadStore(OffloadConfig(data_dir=str(tmp_path / name), dram_bytes=2 * NBYTES,
                                           disk_bytes=3 * NBYTES, pool_dir=SHM_DIR, remote_url=redis_url,
                                           remote_key_prefix=remote_prefix,
                                           remote_index_blocks=remote_index_blocks))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_events_follow_saves_evictions_remote_and_restart(make_store: Store, make_pool: PoolFactory,
                                                         redis_url: str) -> None:
    a, b = make_store("a"), make_store("b")
    pool_a, pool_b = make_pool(), make_pool()
    a.attach_pool(pool_a.handle)
    b.attach_pool(pool_b.handle)
    ma, mb = Mirror(a), Mirror(b)
    for i in range(1, 7):
        pool_a.fill_random(i, seed=i)
    a.save([(_h(i), i) for i in (1, 2, 3)])  # DRAM holds 2: block 1 is demoted to disk
    snap = ma.check(a)
    assert (set(snap.dram), set(snap.disk), set(snap.remote)) == ({_h(2), _h(3)}, {_h(1)}, {_h(1), _h(2), _h(3)})
    a.save([(_h(i), i) for i in (4, 5, 6)])  # disk holds 3: the oldest demoted ones go
    snap = ma.check(a)
    assert set(snap.dram) == {_h(5), _h(6)} and set(snap.disk) == {_h(2), _h(3), _h(4)}
    assert set(snap.dram) == set(a._dram) and set(snap.disk) == set(a._disk.hashes())  # the tiers themselves
    assert len(snap.remote) == 6

    assert b.lookup([_h(1), _h(2)]) == (2, 0)  # B learns remote residency from what it is asked
    assert b.load([(_h(1), 1), (_h(2), 2)]).num_loaded == 2  # served remote, promoted to B's DRAM
    snap_b = mb.check(b)
    assert set(snap_b.dram) == {_h(1), _h(2)} and set(snap_b.remote) == {_h(1), _h(2)}

    assert a.remote is not None
    raw = redis.Redis.from_url(redis_url)
    raw.delete(a.remote.key(_h(3)))  # an eviction Redis does on its own: nobody is told...
    raw.close()
    assert b.lookup([_h(1), _h(2), _h(3)]) == (2, 2)  # ...until a store finds it missing
    assert _h(3) not in mb.check(b).remote
    before = ma.seq
    ma.check(a)
    assert ma.seq == before and _h(3) in ma.tiers["remote"]  # A's view stays approximate (docs/mesh.md)

    a.close()  # restart: a new process, a new hub; DRAM is gone, the disk tier is reconciled
    a2 = make_store("a")
    snap = Mirror(a2).check(a2)
    assert (snap.seq, set(snap.dram), set(snap.disk), snap.remote) == (0, set(), {_h(2), _h(3), _h(4)}, ())


def test_remote_view_is_bounded(make_store: Store, make_pool: PoolFactory) -> None:
    a = make_store("a", remote_index_blocks=2)
    pool = make_pool()
    a.attach_pool(pool.handle)
    m = Mirror(a)
    a.save([(_h(i), i) for i in (1, 2, 3)])
    assert set(m.check(a).remote) == {_h(2), _h(3)}  # least recently confirmed dropped, with an event
    off = make_store("off", remote_index_blocks=0)
    off.attach_pool(make_pool().handle)
    m_off = Mirror(off)
    off.save([(_h(1), 1)])
    assert m_off.check(off).remote == ()
