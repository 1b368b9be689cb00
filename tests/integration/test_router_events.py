"""The router's event feed against a real kv-cache-manager gRPC server (in-process, no model):
after churn (evictions), a replica's restart, a dropped stream and a gap in the batch numbers,
the router's index for the replica equals the pool's real hash map (snapshot + later events),
including blocks stored before the (re)subscription. Traffic goes through the server's gRPC API
(as the scheduler's) whenever the router may be resyncing, so the manager's lock orders it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
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
from shared.hashing import hash_blocks
from shared.owner_channel import with_owner
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc
from tests.unit.kv_cache_manager.helpers import SEED, make_manager, new, running


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


def truth(kvm: KVM) -> set[bytes]:
    """The replica's real hashed blocks."""
    return set(kvm.manager.pool.cached)


def owner_stub(kvm: KVM) -> tuple[grpc.Channel, kvm_grpc.KVCacheManagerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{kvm.server.port}")
    return channel, kvm_grpc.KVCacheManagerStub(with_owner(channel, "test-scheduler"))


def rpc_traffic(stub: kvm_grpc.KVCacheManagerStub, tag: int, n: int = 6) -> None:
    """:func:`traffic` through the gRPC API: prefill, one decode, free."""
    for i in range(n):
        rid = f"g{tag}-{i}"
        tokens = [tag * 1000 + i * 50 + j for j in range(14)]
        stub.AllocateSlots(kvm_pb2.AllocateSlotsRequest(allocations=[kvm_pb2.Allocation(
            request_id=rid, new_token_ids=tokens, num_new_tokens=14, is_new=True, use_prefix_cache=True,
            block_hashes=hash_blocks(SEED, tokens, 4))]), timeout=10)  # the scheduler's hashes
        stub.AllocateSlots(kvm_pb2.AllocateSlotsRequest(allocations=[kvm_pb2.Allocation(
            request_id=rid, new_token_ids=[1], num_new_tokens=1)]), timeout=10)
        stub.Free(kvm_pb2.FreeRequest(request_ids=[rid]), timeout=10)


def test_the_snapshot_brings_blocks_stored_before_the_subscription() -> None:
    kvm = serve_kvm()
    traffic(kvm.manager, 1)  # nobody subscribed: no events at all, only the pool
    assert kvm.manager.stats().num_evictions > 0 and kvm.hub.seq == 0
    index = PrefixIndex()
    config = RouterConfig(health_interval_seconds=3600, reconnect_min_seconds=0.05, reconnect_max_seconds=0.2)
    replica = Replica(ReplicaAddress("a", "127.0.0.1:1", f"127.0.0.1:{kvm.server.port}"), config, index)
    replica.start()
    try:
        wait_for(lambda: replica.subscribed)
        assert index.blocks("a") == truth(kvm) and len(truth(kvm)) == 11 and index.last_seq("a") == 0
        channel, stub = owner_stub(kvm)
        with channel:
            rpc_traffic(stub, 2)  # churn: every new block evicts a snapshot one
        wait_for(lambda: index.last_seq("a") == kvm.hub.seq)
        assert index.blocks("a") == truth(kvm)
    finally:
        replica.close()
        kvm.stop()


def test_after_a_restart_the_index_equals_the_new_pool(setup: tuple[KVM, Replica, PrefixIndex]) -> None:
    kvm, replica, index = setup
    traffic(kvm.manager, 1)
    assert kvm.manager.stats().num_evictions > 0
    wait_for(lambda: index.last_seq("a") == kvm.hub.seq)
    assert index.blocks("a") == truth(kvm)
    old = truth(kvm)
    port = kvm.server.port
    kvm.stop()
    wait_for(lambda: not replica.subscribed and index.num_blocks("a") == 0)
    # The replica comes back on the same address with a pool that already holds blocks (stored
    # before the router could reconnect: no event of theirs will ever reach it).
    hub = EventHub()
    binding = ManagerBinding(hub)
    binding.initialize("test-scheduler", make_manager(num_blocks=13, block_size=4).config, "pool-2", 3600.0)
    traffic(binding.manager(), 2, n=2)
    servicer = KVCacheManagerServicer(binding, hub)
    server = start_server(ServerConfig(port=port), [
        ServiceRegistration(SERVICE.grpc, servicer, kvm_grpc.add_KVCacheManagerServicer_to_server)])
    restarted = KVM(binding.manager(), hub, servicer, server)
    try:
        wait_for(lambda: replica.subscribed and replica.subscriptions == 2, timeout=10)
        assert index.blocks("a") == truth(restarted) != set() and not index.blocks("a") & old
        channel, stub = owner_stub(restarted)
        with channel:
            rpc_traffic(stub, 3)
        wait_for(lambda: index.last_seq("a") == restarted.hub.seq)
        assert index.blocks("a") == truth(restarted)
    finally:
        restarted.stop()


def test_a_dropped_stream_and_a_gap_each_resync_to_the_pool(setup: tuple[KVM, Replica, PrefixIndex]) -> None:
    kvm, replica, index = setup
    channel, stub = owner_stub(kvm)
    with channel:
        rpc_traffic(stub, 1, n=2)
        wait_for(lambda: index.last_seq("a") == kvm.hub.seq)
        assert index.blocks("a") == truth(kvm) != set()
        kvm.hub.close()  # the server drops every event stream (e.g. a subscriber that fell behind)
        rpc_traffic(stub, 2, n=2)  # meanwhile the pool changes; some of it may publish to nobody
        wait_for(lambda: replica.subscribed and replica.subscriptions == 2)
        rpc_traffic(stub, 3, n=1)
        wait_for(lambda: index.last_seq("a") == kvm.hub.seq)
        assert index.blocks("a") == truth(kvm)
        kvm.hub._seq += 1  # one batch lost in transit: the next one arrives numbered last + 2
        rpc_traffic(stub, 4, n=3)  # the gap's batch (skipped), then more while the router resyncs
        wait_for(lambda: replica.subscriptions == 3 and index.last_seq("a") == kvm.hub.seq)
        assert index.blocks("a") == truth(kvm)


def test_resyncs_under_concurrent_traffic_end_equal_to_the_pool(setup: tuple[KVM, Replica, PrefixIndex]) -> None:
    """Streams dropped while another thread drives steps: snapshots and batches interleave
    arbitrarily, and the seq rule (skip <= snapshot, apply the rest) still lands on the pool."""
    kvm, replica, index = setup
    channel, stub = owner_stub(kvm)
    stop = threading.Event()
    steps: list[int] = []

    def drive() -> None:
        tag = 10
        while not stop.is_set():
            rpc_traffic(stub, tag, n=1)
            steps.append(tag)
            tag += 1

    with channel:
        worker = threading.Thread(target=drive)
        worker.start()
        try:
            for drop in range(1, 6):
                kvm.hub.close()
                wait_for(lambda d=drop: replica.subscriptions > d, timeout=10)
                time.sleep(0.02)
        finally:
            stop.set()
            worker.join()
    assert len(steps) >= 5
    wait_for(lambda: replica.subscribed and index.last_seq("a") == kvm.hub.seq)
    assert index.blocks("a") == truth(kvm)
