"""The router's offload feed against a real offload-store gRPC server (in-process, no model,
a shared-memory pool file, real Redis under a unique prefix): after saves that spill DRAM to disk
and evict from disk, a dropped stream, a gap in the batch numbers and a store restart, the
router's per-tier offload index for the replica equals the store's real tiers (its snapshot RPC
and the tiers themselves). Saves go through the store's gRPC API (as the scheduler's), so the
servicer's lock orders them against the router's snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.offload_store.client import RemoteOffload
from services.offload_store.config import OffloadConfig
from services.offload_store.servicer import SERVICE, OffloadStoreServicer
from services.offload_store.store import OffloadStore
from services.offload_store.types import TIERS
from services.router.client import Replica
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.offload_index import OffloadIndex
from services.router.types import ReplicaAddress
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.pb.kvmesh.v1 import offload_store_pb2 as pb
from shared.pb.kvmesh.v1 import offload_store_pb2_grpc
from tests.integration.test_router_events import wait_for
from tests.unit.offload_store.offload_testlib import SHM_DIR, PoolFactory, ShmPool, make_pool

__all__ = ["make_pool"]  # the pool-file fixture
pytestmark = pytest.mark.redis
NBYTES = 1024  # one block of the default test pool


def _h(i: int) -> bytes:
    return bytes([i]) * 32


@dataclass
class Store:
    core: OffloadStore
    server: RunningServer

    def stop(self) -> None:
        self.core.hub.close()
        self.server.stop(0)
        self.core.close()

    def tiers(self) -> dict[str, set[bytes]]:
        """The truth, from the snapshot RPC, checked against the tiers themselves."""
        with grpc.insecure_channel(f"127.0.0.1:{self.server.port}") as channel:
            snap = offload_store_pb2_grpc.OffloadStoreStub(channel).GetStoredBlocks(pb.GetStoredBlocksRequest())
        truth = {"dram": set(snap.dram_hashes), "disk": set(snap.disk_hashes), "remote": set(snap.remote_hashes)}
        assert truth["dram"] == set(self.core._dram) and truth["disk"] == set(self.core._disk.hashes())
        return truth


def serve_store(data_dir: Path, redis_url: str, prefix: str, port: int = 0) -> Store:
    core = OffloadStore(OffloadConfig(data_dir=str(data_dir), dram_bytes=2 * NBYTES, disk_bytes=3 * NBYTES,
                                      pool_dir=SHM_DIR, remote_url=redis_url, remote_key_prefix=prefix))
    server = start_server(ServerConfig(port=port), [ServiceRegistration(
        SERVICE.grpc, OffloadStoreServicer(core), offload_store_pb2_grpc.add_OffloadStoreServicer_to_server)])
    return Store(core, server)


@pytest.fixture()
def setup(tmp_path: Path, redis_url: str, remote_prefix: str, make_pool: PoolFactory
          ) -> Iterator[tuple[Store, Replica, OffloadIndex, RemoteOffload, ShmPool]]:
    store = serve_store(tmp_path / "store", redis_url, remote_prefix)
    offload = OffloadIndex()
    # Neither the scheduler nor the kv-cache-manager is dialled to any effect here (port 1).
    config = RouterConfig(health_interval_seconds=3600, reconnect_min_seconds=0.05, reconnect_max_seconds=0.2)
    address = ReplicaAddress("a", "127.0.0.1:1", "127.0.0.1:1", offload_address=f"127.0.0.1:{store.server.port}")
    replica = Replica(address, config, PrefixIndex(), offload=offload)
    replica.start()
    wait_for(lambda: replica.offload_subscribed)
    pool = make_pool()
    for b in range(1, 8):
        pool.fill_random(b, seed=b)
    scheduler = RemoteOffload(f"127.0.0.1:{store.server.port}", timeout=10, owner_id="test-scheduler")
    scheduler.attach(pool.handle)
    yield store, replica, offload, scheduler, pool
    scheduler.close()
    replica.close()
    store.stop()


def view(offload: OffloadIndex) -> dict[str, set[bytes]]:
    return {t: set(offload.blocks("a", t)) for t in TIERS}


def test_the_offload_index_follows_saves_drops_gaps_and_a_restart(
        setup: tuple[Store, Replica, OffloadIndex, RemoteOffload, ShmPool], tmp_path: Path, redis_url: str,
        remote_prefix: str) -> None:
    store, replica, offload, scheduler, pool = setup
    assert scheduler.save([(_h(i), i) for i in (1, 2, 3)]) == 3  # DRAM holds 2: block 1 goes to disk
    wait_for(lambda: offload.last_seq("a") == store.core.hub.seq)
    assert view(offload) == store.tiers() == {"dram": {_h(2), _h(3)}, "disk": {_h(1)},
                                              "remote": {_h(1), _h(2), _h(3)}}
    store.core.hub.close()  # the server drops the stream (a subscriber that fell behind)
    scheduler.save([(_h(i), i) for i in (4, 5)])  # meanwhile the tiers change; maybe seen by nobody
    wait_for(lambda: replica.offload_subscriptions == 2 and replica.offload_subscribed)
    scheduler.save([(_h(6), 6)])  # disk holds 3: its oldest block is evicted
    wait_for(lambda: offload.last_seq("a") == store.core.hub.seq)
    assert view(offload) == store.tiers()
    assert view(offload)["dram"] == {_h(5), _h(6)} and view(offload)["disk"] == {_h(2), _h(3), _h(4)}
    store.core.hub._seq += 1  # one batch lost in transit: the next one arrives numbered last + 2
    scheduler.save([(_h(7), 7)])
    wait_for(lambda: replica.offload_subscriptions == 3 and offload.last_seq("a") == store.core.hub.seq)
    assert view(offload) == store.tiers() and _h(7) in view(offload)["dram"]

    port = store.server.port
    disk = store.tiers()["disk"]
    store.stop()  # a restart: the router forgets the store until it is back
    wait_for(lambda: not replica.offload_subscribed and all(not v for v in view(offload).values()))
    restarted = serve_store(tmp_path / "store", redis_url, remote_prefix, port)
    try:
        wait_for(lambda: replica.offload_subscribed and replica.offload_subscriptions == 4, timeout=10)
        assert view(offload) == restarted.tiers() == {"dram": set(), "disk": disk, "remote": set()}
        again = RemoteOffload(f"127.0.0.1:{port}", timeout=10, owner_id="test-scheduler")
        again.attach(pool.handle)
        assert again.load([(_h(7), 1)]) == 1  # a disk hit promoted to DRAM: one more batch
        again.close()
        wait_for(lambda: offload.last_seq("a") == restarted.core.hub.seq)
        assert view(offload) == restarted.tiers() and view(offload)["dram"] == {_h(7)}
    finally:
        restarted.stop()
