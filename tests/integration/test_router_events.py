"""The router's event client against a real kv-cache-manager gRPC server (in-process, no model):
after a replica's restart, a dropped stream and a gap in the batch numbers, the index is
cleared, resubscribed and equals what the pool has stored since."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from services.kv_cache_manager.binding import ManagerBinding
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.servicer import SERVICE, KVCacheManagerServicer
from services.router.client import Replica
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.types import ReplicaAddress
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc
from tests.unit.kv_cache_manager.helpers import make_manager, new, running


@dataclass
class KVM:
    manager: KVCacheManager
    hub: EventHub
    servicer: KVCacheManagerServicer
    server: RunningServer

    def stop(self) -> None:
        self.servicer.close()
        self.server.stop(0)


def serve_kvm(port: int = 0) -> KVM:
    hub = EventHub()
    binding = ManagerBinding(hub)  # bound as a scheduler would (the manager serves nothing before)
    binding.initialize("test-scheduler", make_manager(num_blocks=13, block_size=4).config, "pool-1", 3600.0)
    manager = binding.manager()
    servicer = KVCacheManagerServicer(binding, hub)
    server = start_server(ServerConfig(port=port), [
        ServiceRegistration(SERVICE.grpc, servicer, kvm_grpc.add_KVCacheManagerServicer_to_server)])
    return KVM(manager, hub, servicer, server)


def traffic(m: KVCacheManager, tag: int, n: int = 6) -> None:
    """``n`` requests on a 12-block pool: prefill, one decode, free (evictions after the third)."""
    for i in range(n):
        rid = f"t{tag}-{i}"
        m.step([], [new(rid, [tag * 1000 + i * 50 + j for j in range(14)], block_size=4)])
        m.step([], [running(rid, [1], 1)])
        m.free([rid])


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def setup() -> Iterator[tuple[KVM, Replica, PrefixIndex]]:
    kvm = serve_kvm()
    index = PrefixIndex()
    # The scheduler address is never dialled here: the probe loop first runs after an hour.
    config = RouterConfig(health_interval_seconds=3600, reconnect_min_seconds=0.05, reconnect_max_seconds=0.2)
    replica = Replica(ReplicaAddress("a", "127.0.0.1:1", f"127.0.0.1:{kvm.server.port}"), config, index)
    replica.start()
    wait_for(lambda: replica.subscribed)
    yield kvm, replica, index
    replica.close()
    kvm.stop()


def test_index_follows_the_pool_then_a_restart_clears_and_relearns(setup: tuple[KVM, Replica, PrefixIndex]) -> None:
    kvm, replica, index = setup
    traffic(kvm.manager, 1)
    assert kvm.manager.stats().num_evictions > 0
    wait_for(lambda: index.blocks("a") == set(kvm.manager.pool.cached))
    old = set(kvm.manager.pool.cached)
    port = kvm.server.port
    kvm.stop()
    wait_for(lambda: not replica.subscribed and index.num_blocks("a") == 0)
    restarted = serve_kvm(port)  # the replica comes back, empty, on the same address
    try:
        wait_for(lambda: replica.subscribed and replica.subscriptions == 2, timeout=10)
        traffic(restarted.manager, 2)
        wait_for(lambda: index.blocks("a") == set(restarted.manager.pool.cached))
        assert not index.blocks("a") & old
    finally:
        restarted.stop()


def test_a_dropped_stream_and_a_gap_each_resync(setup: tuple[KVM, Replica, PrefixIndex]) -> None:
    kvm, replica, index = setup
    traffic(kvm.manager, 1, n=2)
    wait_for(lambda: index.blocks("a") == set(kvm.manager.pool.cached) and index.num_blocks("a") > 0)
    kvm.hub.close()  # the server drops every event stream (e.g. a subscriber that fell behind)
    wait_for(lambda: replica.subscribed and replica.subscriptions == 2)
    # What the pool held before the new subscription is forgotten (no snapshot RPC yet): the
    # index may miss, but never claims a block the pool lacks, and relearns from new events.
    assert index.num_blocks("a") == 0
    before = set(kvm.manager.pool.cached)
    traffic(kvm.manager, 2, n=2)
    wait_for(lambda: index.blocks("a") == set(kvm.manager.pool.cached) - before)
    resyncs = replica.subscriptions
    kvm.hub._seq += 1  # one batch lost in transit: the next one arrives numbered last + 2
    traffic(kvm.manager, 3, n=1)
    wait_for(lambda: replica.subscribed and replica.subscriptions == resyncs + 1)
    before = set(kvm.manager.pool.cached)
    traffic(kvm.manager, 4, n=2)
    assert set(kvm.manager.pool.cached) - before  # something new to learn
    wait_for(lambda: index.blocks("a") == set(kvm.manager.pool.cached) - before)
