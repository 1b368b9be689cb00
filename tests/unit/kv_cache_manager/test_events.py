"""The event hub (fan-out, bounded queues, close) and the SubscribeEvents stream's lifecycle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.servicer import SERVICE, KVCacheManagerServicer
from services.kv_cache_manager.types import AllBlocksCleared, BlockRemoved, KVEventBatch
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.hashing import BlockHash
from shared.owner_channel import with_owner
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc

from .helpers import OWNER, hashes_of, make_binding, make_manager, new, seq

CLEARED = (AllBlocksCleared(),)


def test_each_subscriber_gets_every_batch_after_it_subscribed_with_growing_seq() -> None:
    hub = EventHub()
    first = hub.subscribe()
    hub.publish(CLEARED)
    second = hub.subscribe()
    removed = (BlockRemoved((BlockHash(b"h" * 32),)),)
    hub.publish(removed)
    hub.publish([])  # nothing happened: no batch
    assert [first.get(0), first.get(0), first.get(0)] == [KVEventBatch(1, CLEARED), KVEventBatch(2, removed), None]
    assert [second.get(0), second.get(0)] == [KVEventBatch(2, removed), None]


def test_a_subscriber_that_falls_behind_is_dropped_not_waited_for() -> None:
    hub = EventHub(max_pending=2)
    slow, fast = hub.subscribe(), hub.subscribe()
    for _ in range(3):
        hub.publish(CLEARED)
        assert fast.get(0) is not None
    assert slow.overflowed and slow.closed
    assert [b.seq for b in slow] == [1, 2]  # what it had queued can still be read, then it ends
    hub.publish(CLEARED)
    assert fast.get(0) == KVEventBatch(4, CLEARED)


def test_close_ends_iteration_and_unsubscribes() -> None:
    hub = EventHub()
    sub = hub.subscribe()
    got: list[KVEventBatch] = []
    reader = threading.Thread(target=lambda: got.extend(sub))
    reader.start()
    hub.publish(CLEARED)
    hub.close()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert got == [KVEventBatch(1, CLEARED)]
    assert not hub.has_subscribers


def test_no_events_are_built_without_subscribers() -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    m.step((), [new("a", seq(0, 48))])
    sub = hub.subscribe()
    assert sub.get(0) is None
    m.step((), [new("b", seq(100, 16))])
    batch = sub.get(0)
    assert batch is not None and batch.seq == 1


@pytest.fixture
def server() -> Iterator[tuple[RunningServer, EventHub, KVCacheManagerServicer]]:
    hub = EventHub()
    servicer = KVCacheManagerServicer(make_binding(hub), hub, max_subscribers=2)
    running = start_server(ServerConfig(port=0, max_workers=4),
                           [ServiceRegistration(SERVICE.grpc, servicer, pb_grpc.add_KVCacheManagerServicer_to_server)])
    yield running, hub, servicer
    servicer.close()
    running.stop(grace=0)


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_client_cancel_removes_the_subscription(
        server: tuple[RunningServer, EventHub, KVCacheManagerServicer]) -> None:
    running, hub, _ = server
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = pb_grpc.KVCacheManagerStub(with_owner(ch, OWNER))
        stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
        stream.initial_metadata()
        assert hub.has_subscribers
        stub.AllocateSlots(pb.AllocateSlotsRequest(allocations=[
            pb.Allocation(request_id="a", new_token_ids=seq(0, 16), num_new_tokens=16, is_new=True,
                          use_prefix_cache=True, block_hashes=hashes_of(seq(0, 16)))]), timeout=5)
        assert next(iter(stream)).events[0].stored.block_ids == [1]
        stream.cancel()
        assert wait_until(lambda: not hub.has_subscribers)


def test_server_side_close_ends_streams_with_ok(
        server: tuple[RunningServer, EventHub, KVCacheManagerServicer]) -> None:
    running, _, servicer = server
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stream = pb_grpc.KVCacheManagerStub(ch).SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
        stream.initial_metadata()
        servicer.close()
        assert list(stream) == []
        assert stream.code() == grpc.StatusCode.OK


def test_subscribers_beyond_the_cap_are_refused(
        server: tuple[RunningServer, EventHub, KVCacheManagerServicer]) -> None:
    running, hub, _ = server
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = pb_grpc.KVCacheManagerStub(ch)
        streams = [stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30) for _ in range(2)]
        for stream in streams:
            stream.initial_metadata()
        third = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            next(iter(third))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams[0].cancel()
        assert wait_until(lambda: hub.num_subscribers == 1)
        fourth = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
        fourth.initial_metadata()
        assert hub.num_subscribers == 2
        fourth.cancel()
        streams[1].cancel()


def test_manager_is_usable_without_a_hub() -> None:
    m = KVCacheManager(make_manager().config)
    assert m.step((), [new("a", seq(0, 32))]).results[0].new_block_ids == (1, 2)
