"""The kv-cache-manager as a real process over gRPC: scenario, status codes, events, health, stop.

Pool: 11 blocks of 16 tokens (block 0 null). Every test starts from a fresh pool (Initialize with
a new pool incarnation), as the owner :data:`OWNER` (metadata on every call of ``stub``).
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.hashing import hash_blocks, hash_seed
from shared.launcher import ServiceProcess
from shared.owner_channel import with_owner
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc

ENV: dict[str, str] = {}  # nothing about the pool: it all comes with Initialize
SEED = hash_seed(b"it-key", "it-model")  # the scheduler's: this test plays the scheduler and hashes
OWNER = "it-scheduler"


def init_request(num_blocks: int = 11, pool_id: str = "") -> pb.InitializeRequest:
    """The owner's Initialize: geometry and a fresh pool incarnation unless one is given (no seed)."""
    return pb.InitializeRequest(num_blocks=num_blocks, block_size=16, max_model_len=256, model_id="it-model",
                                pool_id=pool_id or uuid.uuid4().hex, lease_seconds=60)
SERVICE = "kvmesh.v1.KVCacheManager"
A = list(range(55))
B = A[:48] + list(range(1000, 1005))
OK = pb.AllocationResult.STATUS_OK
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    with ServiceProcess("kv-cache-manager", env=ENV) as proc:
        yield proc


@pytest.fixture(scope="module")
def channel(service: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(service.address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.KVCacheManagerStub:
    s = pb_grpc.KVCacheManagerStub(with_owner(channel, OWNER))
    s.Initialize(init_request(), timeout=TIMEOUT)
    return s


def new(rid: str, tokens: list[int], num_new: int | None = None) -> pb.Allocation:
    """A new request's allocation with the hashes of its full blocks, as the scheduler sends it."""
    num = len(tokens) if num_new is None else num_new
    return pb.Allocation(request_id=rid, new_token_ids=tokens, num_new_tokens=num, is_new=True, use_prefix_cache=True,
                         block_hashes=hash_blocks(SEED, tokens, 16))


def lookup(tokens: list[int]) -> pb.LookupPrefixRequest:
    """The read-only query for ``tokens``: the hashes of every block but the one with the last token."""
    return pb.LookupPrefixRequest(block_hashes=hash_blocks(SEED, tokens, 16)[: (len(tokens) - 1) // 16])


def step(stub: pb_grpc.KVCacheManagerStub, free: list[str], allocs: list[pb.Allocation]) -> pb.AllocateSlotsResponse:
    return stub.AllocateSlots(pb.AllocateSlotsRequest(free_request_ids=free, allocations=allocs), timeout=TIMEOUT)


def observable(stub: pb_grpc.KVCacheManagerStub, live: list[str]) -> tuple[object, ...]:
    """Stats and block tables (and integrity must hold)."""
    assert stub.CheckIntegrity(pb.CheckIntegrityRequest(), timeout=TIMEOUT).ok
    tables = [stub.GetBlockTable(pb.GetBlockTableRequest(request_id=r), timeout=TIMEOUT) for r in live]
    return stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT), tables


def test_prefix_sharing_scenario_with_exact_block_ids(stub: pb_grpc.KVCacheManagerStub) -> None:
    ra = step(stub, [], [new("a", A)]).results[0]
    assert (ra.status, list(ra.new_block_ids), ra.num_computed_tokens, ra.num_new_tokens) == (OK, [1, 2, 3, 4], 0, 55)
    rb = step(stub, [], [new("b", B)])
    r = rb.results[0]
    assert list(r.new_block_ids) == [1, 2, 3, 5]
    assert (r.num_computed_tokens, r.num_cached_tokens, r.num_new_tokens) == (48, 48, 5)
    assert (rb.stats.num_free_blocks, rb.stats.num_cached_blocks, rb.stats.prefix_cache_hits) == (5, 3, 48)
    table = stub.GetBlockTable(pb.GetBlockTableRequest(request_id="a"), timeout=TIMEOUT)
    hashes = hash_blocks(SEED, A, 16)
    assert (list(table.block_ids), table.num_tokens, list(table.block_hashes)) == ([1, 2, 3, 4], 55, hashes)
    found = stub.LookupPrefix(lookup(A), timeout=TIMEOUT)
    assert (found.num_cached_tokens, list(found.block_ids)) == (48, [1, 2, 3])

    free = stub.Free(pb.FreeRequest(request_ids=["a", "b"]), timeout=TIMEOUT)
    assert (free.stats.num_free_blocks, free.stats.num_requests, free.stats.usage_percent) == (10, 0, 0.0)
    rc = step(stub, [], [new("c", list(range(5000, 5160)))])
    assert list(rc.results[0].new_block_ids) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert [(e.block_id, e.block_hash) for e in rc.evicted] == [(3, hashes[2]), (2, hashes[1]), (1, hashes[0])]
    assert rc.stats.num_evictions == 3
    step(stub, ["c"], [])
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=TIMEOUT).num_cleared == 10
    assert stub.CheckIntegrity(pb.CheckIntegrityRequest(), timeout=TIMEOUT).ok


def test_rollback_unregisters_blocks_whose_step_never_ran(stub: pb_grpc.KVCacheManagerStub) -> None:
    step(stub, [], [new("a", A)])
    rolled = stub.AllocateSlots(pb.AllocateSlotsRequest(rollback_request_ids=["a"]), timeout=TIMEOUT)
    assert (rolled.stats.num_cached_blocks, rolled.stats.num_free_blocks) == (0, 10)
    step(stub, [], [new("b", A)])
    freed = stub.Free(pb.FreeRequest(rollback_request_ids=["b"]), timeout=TIMEOUT)
    assert freed.stats.num_cached_blocks == 0
    r = step(stub, [], [new("c", A)]).results[0]
    assert (r.num_cached_tokens, list(r.new_block_ids)) == (0, [1, 2, 3, 4])
    with pytest.raises(grpc.RpcError) as err:
        stub.Free(pb.FreeRequest(request_ids=["c"], rollback_request_ids=["c"]), timeout=TIMEOUT)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    step(stub, ["c"], [])


def test_out_of_blocks_is_a_status_not_an_error(stub: pb_grpc.KVCacheManagerStub) -> None:
    step(stub, [], [new("x", list(range(100)))])
    before = observable(stub, ["x"])
    resp = step(stub, [], [new("y", list(range(500, 564)))])
    assert [(r.request_id, r.status, list(r.new_block_ids)) for r in resp.results] == [
        ("y", pb.AllocationResult.STATUS_OUT_OF_BLOCKS, [])]
    assert observable(stub, ["x"]) == before
    stub.Free(pb.FreeRequest(request_ids=["x"]), timeout=TIMEOUT)


BAD_CASES = [
    ("unknown free id", lambda s: step(s, ["nope"], []), grpc.StatusCode.NOT_FOUND),
    ("unknown running id", lambda s: step(s, [], [pb.Allocation(request_id="nope", num_new_tokens=1)]),
     grpc.StatusCode.NOT_FOUND),
    ("live id sent as new", lambda s: step(s, [], [new("live", [1, 2])]), grpc.StatusCode.ALREADY_EXISTS),
    ("duplicate ids in a step", lambda s: step(s, [], [new("d", [1]), new("d", [2])]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("negative num_new_tokens", lambda s: step(s, [], [new("d", [1, 2], num_new=-1)]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("negative token id", lambda s: step(s, [], [new("d", [1, -5])]), grpc.StatusCode.INVALID_ARGUMENT),
    ("beyond max_model_len", lambda s: step(s, [], [new("d", list(range(257)))]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("valid allocation before a bad one", lambda s: step(s, [], [new("d", [1, 2]), new("live", [3])]),
     grpc.StatusCode.ALREADY_EXISTS),
    ("free of unknown id", lambda s: s.Free(pb.FreeRequest(request_ids=["nope"]), timeout=TIMEOUT),
     grpc.StatusCode.NOT_FOUND),
    ("block table of unknown id",
     lambda s: s.GetBlockTable(pb.GetBlockTableRequest(request_id="nope"), timeout=TIMEOUT), grpc.StatusCode.NOT_FOUND),
    ("lookup with a short hash", lambda s: s.LookupPrefix(pb.LookupPrefixRequest(block_hashes=[b"x"]),
                                                         timeout=TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT),
    ("reset while in use", lambda s: s.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=TIMEOUT),
     grpc.StatusCode.FAILED_PRECONDITION),
    ("initialize without a lease", lambda s: s.Initialize(pb.InitializeRequest(
        num_blocks=11, block_size=16, max_model_len=256), timeout=TIMEOUT),
     grpc.StatusCode.INVALID_ARGUMENT),
]


def test_bad_input_maps_to_status_codes_and_changes_nothing(stub: pb_grpc.KVCacheManagerStub) -> None:
    step(stub, [], [new("live", list(range(40)))])
    before = observable(stub, ["live"])
    for name, call, code in BAD_CASES:
        with pytest.raises(grpc.RpcError) as info:
            call(stub)
        assert info.value.code() == code, name
        assert observable(stub, ["live"]) == before, name
    stub.Free(pb.FreeRequest(request_ids=["live"]), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        stub.Initialize(init_request(num_blocks=1), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_only_the_owner_may_change_or_read_request_state(stub: pb_grpc.KVCacheManagerStub,
                                                         channel: grpc.Channel) -> None:
    """Issue 12 item 7: Initialize(num_blocks=4), ResetPrefixCache and LookupPrefix were open to anyone."""
    step(stub, [], [new("a", A)])
    step(stub, ["a"], [])  # idle but serving: A's 3 blocks cached
    before = observable(stub, [])
    stranger = pb_grpc.KVCacheManagerStub(with_owner(channel, "stranger"))
    anonymous = pb_grpc.KVCacheManagerStub(channel)
    calls = [
        ("Initialize", lambda s: s.Initialize(init_request(num_blocks=4), timeout=TIMEOUT)),
        ("ResetPrefixCache", lambda s: s.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=TIMEOUT)),
        ("AllocateSlots", lambda s: step(s, [], [new("x", B)])),
        ("Free", lambda s: s.Free(pb.FreeRequest(), timeout=TIMEOUT)),
        ("Release", lambda s: s.Release(pb.ReleaseRequest(), timeout=TIMEOUT)),
    ]
    for who, s in (("stranger", stranger), ("anonymous", anonymous)):
        for name, call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call(s)
            expected = (grpc.StatusCode.INVALID_ARGUMENT if who == "anonymous" and name == "Initialize"
                        else grpc.StatusCode.FAILED_PRECONDITION)
            assert info.value.code() == expected, (who, name, info.value.details())
            assert observable(stub, []) == before, (who, name)
    assert "owned by another scheduler" in _details(lambda: calls[0][1](stranger))
    assert "not the owner" in _details(lambda: calls[1][1](stranger))
    # A prefix query answers how much is cached, but only the owner learns the block ids.
    for s in (stranger, anonymous):
        assert s.LookupPrefix(lookup(A), timeout=TIMEOUT) == pb.LookupPrefixResponse(num_cached_tokens=48)
    # Aggregates stay open to monitoring; the owner still serves.
    assert stranger.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_cached_blocks == 3
    assert stub.LookupPrefix(lookup(A), timeout=TIMEOUT).num_cached_tokens == 48


def test_release_lets_a_successor_take_over_at_once(stub: pb_grpc.KVCacheManagerStub, channel: grpc.Channel) -> None:
    pool = uuid.uuid4().hex
    stub.Initialize(init_request(pool_id=pool), timeout=TIMEOUT)
    step(stub, [], [new("a", A)])
    step(stub, [], [pb.Allocation(request_id="a", new_token_ids=[7], num_new_tokens=1)])
    assert stub.Release(pb.ReleaseRequest(), timeout=TIMEOUT).num_freed_requests == 1
    successor = pb_grpc.KVCacheManagerStub(with_owner(channel, "successor"))
    resp = successor.Initialize(init_request(pool_id=pool), timeout=TIMEOUT)  # same runner pool
    assert (resp.kept_cache, resp.num_freed_requests) == (True, 0)
    assert (resp.stats.num_requests, resp.stats.num_free_blocks, resp.stats.num_cached_blocks) == (0, 10, 3)
    assert successor.LookupPrefix(lookup(A), timeout=TIMEOUT).num_cached_tokens == 48
    with pytest.raises(grpc.RpcError) as info:
        step(stub, [], [new("b", B)])  # the old owner is fenced out
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    successor.Release(pb.ReleaseRequest(), timeout=TIMEOUT)


def _with_hashes(alloc: pb.Allocation, hashes: list[bytes]) -> pb.Allocation:
    out = pb.Allocation()
    out.CopyFrom(alloc)
    del out.block_hashes[:]
    out.block_hashes.extend(hashes)
    return out


HASH_CASES = [
    ("a hash of 31 bytes", lambda: _with_hashes(new("d", A), [b"x" * 31, *hash_blocks(SEED, A, 16)[1:]]),
     "block hash 0 is 31 bytes, not 32"),
    ("more hashes than full blocks", lambda: _with_hashes(new("d", A), hash_blocks(SEED, [*A, *range(9)], 16)),
     "4 block hashes for 3 full blocks"),
    ("fewer hashes than blocks the step completes", lambda: _with_hashes(new("d", A), hash_blocks(SEED, A, 16)[:2]),
     "2 block hashes, but this step can complete 3 blocks"),
    ("a decode completing a block without its hash",
     lambda: pb.Allocation(request_id="live", new_token_ids=list(range(900, 908)), num_new_tokens=8),
     "1 block hashes, but this step can complete 2 blocks"),
]


def test_bad_block_hashes_are_invalid_argument_and_leak_no_block(stub: pb_grpc.KVCacheManagerStub) -> None:
    """The hashes are the scheduler's; the manager checks their size and number before anything changes."""
    step(stub, [], [new("live", list(range(24)))])  # 1 full block, 24 tokens computed
    before = observable(stub, ["live"])
    free_before = stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_free_blocks
    for name, build, detail in HASH_CASES:
        with pytest.raises(grpc.RpcError) as info:
            step(stub, [], [new("ok", B), build()])  # a valid allocation first: not applied either
        assert (info.value.code(), detail in str(info.value.details())) == (grpc.StatusCode.INVALID_ARGUMENT, True), \
            (name, info.value.details())
        assert stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_free_blocks == free_before == 8, name
        assert observable(stub, ["live"]) == before, name
    stub.Free(pb.FreeRequest(request_ids=["live"]), timeout=TIMEOUT)


def _details(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return str(exc.details())
    raise AssertionError("the call succeeded")


def test_subscribers_receive_block_events(stub: pb_grpc.KVCacheManagerStub) -> None:
    stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
    assert dict(stream.initial_metadata())["kvmesh-subscribed"] == "1"
    step(stub, [], [new("a", A)])
    step(stub, ["a"], [new("c", list(range(5000, 5160)))])
    step(stub, ["c"], [])
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=TIMEOUT)
    it = iter(stream)
    batches = [next(it) for _ in range(3)]
    stream.cancel()
    hashes = hash_blocks(SEED, A, 16)
    assert batches[0].seq < batches[1].seq < batches[2].seq
    (stored,) = batches[0].events
    assert list(stored.stored.block_hashes) == hashes
    assert (stored.stored.parent_block_hash, stored.stored.block_size, stored.stored.num_tokens) == (b"", 16, 48)
    assert list(stored.stored.block_ids) == [1, 2, 3]
    removed, stored_c = batches[1].events
    assert list(removed.removed.block_hashes) == hashes[::-1]
    assert list(stored_c.stored.block_ids) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert [e.WhichOneof("event") for e in batches[2].events] == ["cleared"]


def test_cached_blocks_snapshot_is_open_and_numbered_like_the_stream(stub: pb_grpc.KVCacheManagerStub,
                                                                      channel: grpc.Channel) -> None:
    anyone = pb_grpc.KVCacheManagerStub(channel)  # no owner: routers and monitoring read it
    stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
    stream.initial_metadata()
    step(stub, [], [new("a", A)])
    step(stub, ["a"], [new("b", B)])
    snap = anyone.GetCachedBlocks(pb.GetCachedBlocksRequest(), timeout=TIMEOUT)
    it = iter(stream)
    first = next(it)
    stream.cancel()
    hashes = hash_blocks(SEED, A, 16)
    assert snap.seq == first.seq  # b was a full hit: nothing stored, so one batch only
    assert sorted(snap.block_hashes) == sorted(hashes) and len(snap.block_hashes) == 3
    stats = anyone.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    assert snap.instance_id == stats.instance_id != ""
    step(stub, ["b"], [new("c", list(range(5000, 5160)))])  # evicts all three, stores ten
    after = anyone.GetCachedBlocks(pb.GetCachedBlocksRequest(), timeout=TIMEOUT)
    assert after.seq == snap.seq  # nobody subscribed any more: no batch published
    assert sorted(after.block_hashes) == sorted(hash_blocks(SEED, list(range(5000, 5160)), 16))
    step(stub, ["c"], [])


def test_health_and_reflection(service: ServiceProcess, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=TIMEOUT))
    assert SERVICE in {s.name for s in resp.list_services_response.service}


def test_sigterm_ends_event_streams_cleanly_and_exits_zero() -> None:
    proc = ServiceProcess("kv-cache-manager", env=ENV)
    try:
        with grpc.insecure_channel(proc.address) as ch:
            bare = pb_grpc.KVCacheManagerStub(with_owner(ch, OWNER))  # issue 12 item 3: no default pool
            assert bare.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_blocks == 0
            with pytest.raises(grpc.RpcError) as info:
                step(bare, [], [new("a", A)])
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (info.value.details() or "").startswith("not initialized")
            stream = pb_grpc.KVCacheManagerStub(ch).SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
            stream.initial_metadata()
            received: list[pb.KVEventBatch] = []
            reader = threading.Thread(target=lambda: received.extend(stream))
            reader.start()
            proc.proc.send_signal(signal.SIGTERM)
            assert proc.proc.wait(timeout=10) == 0
            reader.join(timeout=10)
            assert not reader.is_alive()
            assert stream.code() == grpc.StatusCode.OK
            assert received == []
    finally:
        assert proc.stop() == 0


def test_a_hybrid_pool_over_grpc_has_group_major_tables_and_refuses_a_negative_window(
        stub: pb_grpc.KVCacheManagerStub) -> None:
    """Initialize with a full group and a window group of 32: the tables of both groups travel
    group-major, a window slides its dead blocks back to the pool, a bad window is INVALID_ARGUMENT."""
    msg = init_request(num_blocks=21)
    msg.kv_group_windows[:] = [0, 32]
    stub.Initialize(msg, timeout=TIMEOUT)
    ra = step(stub, [], [new("a", A)]).results[0]
    assert list(ra.new_block_ids) == [1, 2, 3, 4, 5, 6, 7, 8]
    # A decode at 55: the window group's position 0 (tokens 0..15, all below 55 - 31) is dead;
    # position 1 (16..31) still holds keys 24..31 of the window.
    dec = pb.Allocation(request_id="a", new_token_ids=[9], num_new_tokens=1)
    rd = step(stub, [], [dec])
    assert (list(rd.results[0].new_block_ids), rd.stats.num_free_blocks) == ([], 13)
    table = stub.GetBlockTable(pb.GetBlockTableRequest(request_id="a"), timeout=TIMEOUT)
    assert list(table.block_ids) == [1, 2, 3, 4, 0, 6, 7, 8]
    assert stub.CheckIntegrity(pb.CheckIntegrityRequest(), timeout=TIMEOUT).ok
    msg.kv_group_windows[:] = [0, -1]
    with pytest.raises(grpc.RpcError) as err:
        stub.Initialize(msg, timeout=TIMEOUT)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
