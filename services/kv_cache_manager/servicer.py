"""The gRPC adapter: protobuf in, core call under one lock, protobuf out.

Errors are raised as :mod:`shared.errors` exceptions and mapped to status codes by the
server's interceptor; nothing here decides policy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from services.kv_cache_manager import convert
from services.kv_cache_manager.binding import ManagerBinding
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.metrics import KVCacheMetrics
from services.kv_cache_manager.types import CachedBlocks, KVCacheStats
from shared.errors import InvalidArgument
from shared.event_stream import serve_events
from shared.grpc_server import ServiceName
from shared.hashing import BlockHash
from shared.ownership import owner_from_metadata
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc

SERVICE = ServiceName.of("kv-cache-manager", pb, "KVCacheManager")
# Initial metadata sent once a SubscribeEvents stream is registered: a client that waits for
# it (``call.initial_metadata()``) knows every later operation's events will reach it.


class KVCacheManagerServicer(pb_grpc.KVCacheManagerServicer):
    """Serves one :class:`ManagerBinding` (the manager once a scheduler bound it).

    Who may call what (docs/reliability.md): ``Initialize`` binds the caller as the owner;
    ``AllocateSlots``, ``Free``, ``GetBlockTable``, ``ResetPrefixCache`` and ``Release`` are the
    owner's only; ``LookupPrefix`` answers anyone, but block ids only to the owner;
    ``GetStats``, ``CheckIntegrity``, ``SubscribeEvents`` and ``GetCachedBlocks`` are read-only and open to
    monitoring and routers (``GetStats`` answers before ``Initialize`` too, with ``num_blocks`` 0).

    NOTE: gRPC calls handlers from a thread pool, and the core is not thread-safe; one lock
    serialises every call (each is microseconds to a millisecond, so it is not a bottleneck
    next to the scheduler's one call per step).

    Args:
        binding: the core and its owner.
        hub: the manager's event hub.
        max_subscribers: concurrent SubscribeEvents streams allowed. Each holds a server worker
            thread for its whole life, so an unbounded number would starve the scheduler's calls.
    """

    def __init__(self, binding: ManagerBinding, hub: EventHub, max_subscribers: int = 4,
                 metrics: KVCacheMetrics | None = None) -> None:
        self._binding = binding
        self._hub = hub
        self._max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._metrics = metrics
        self._seen = (0, 0)  # prefix-cache (queries, hits) already exported

    def _export(self, stats: KVCacheStats) -> None:
        """Mirrors the step's stats into Prometheus (counters advance by the delta since last time)."""
        if self._metrics is None:
            return
        self._metrics.set_usage(stats.num_blocks - stats.num_free_blocks, stats.num_blocks)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        dq, dh = queries - self._seen[0], hits - self._seen[1]
        if dq >= 0 and 0 <= dh <= dq:  # counters reset by Initialize: skip that one delta
            self._metrics.record_prefix_lookup(dq, dh)
        self._seen = (queries, hits)

    def _stamp(self, msg: pb.KVCacheStats) -> pb.KVCacheStats:
        """Names this instance and the pool incarnation it is bound to (the scheduler checks both)."""
        msg.instance_id = self._binding.instance_id
        msg.pool_id = self._binding.pool_id
        return msg

    def _stats_pb(self, stats: KVCacheStats) -> pb.KVCacheStats:
        return self._stamp(convert.stats_to_pb(stats))

    def Initialize(self, request: pb.InitializeRequest, context: grpc.ServicerContext) -> pb.InitializeResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        try:
            config = convert.config_from_pb(request)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        with self._lock:
            result = self._binding.initialize(owner, config, request.pool_id, request.lease_seconds)
            self._seen = (result.stats.prefix_cache_queries, result.stats.prefix_cache_hits)
        return pb.InitializeResponse(stats=self._stats_pb(result.stats), kept_cache=result.kept_cache,
                                     num_freed_requests=result.num_freed_requests)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            freed = self._binding.release(owner)
        return pb.ReleaseResponse(num_freed_requests=freed)

    def AllocateSlots(self, request: pb.AllocateSlotsRequest,
                      context: grpc.ServicerContext) -> pb.AllocateSlotsResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        specs = [convert.spec_from_pb(a) for a in request.allocations]
        free_ids = list(request.free_request_ids)
        with self._lock:
            step = self._binding.owned(owner).step(free_ids, specs, list(request.rollback_request_ids))
            self._export(step.stats)
        msg = convert.step_to_pb(step)
        self._stamp(msg.stats)
        return msg

    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            stats = self._binding.owned(owner).free(list(request.request_ids), list(request.rollback_request_ids))
            self._export(stats)  # the engine frees idle requests here: usage must drop with them
        return pb.FreeResponse(stats=self._stats_pb(stats))

    def LookupPrefix(self, request: pb.LookupPrefixRequest,
                     context: grpc.ServicerContext) -> pb.LookupPrefixResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            is_owner = self._binding.lease.is_owner(owner)
            manager = self._binding.owned(owner) if is_owner else self._binding.manager()
            lookup = manager.lookup_prefix([BlockHash(h) for h in request.block_hashes])
        if not is_owner:  # monitoring and routers learn how much is cached, never where
            return pb.LookupPrefixResponse(num_cached_tokens=lookup.num_cached_tokens)
        return convert.lookup_to_pb(lookup)

    def GetBlockTable(self, request: pb.GetBlockTableRequest,
                      context: grpc.ServicerContext) -> pb.GetBlockTableResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            table = self._binding.owned(owner).get_block_table(request.request_id)
        return convert.block_table_to_pb(table)

    def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                         context: grpc.ServicerContext) -> pb.ResetPrefixCacheResponse:
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            num = self._binding.owned(owner).reset_prefix_cache()
        return pb.ResetPrefixCacheResponse(num_cleared=num)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.KVCacheStats:
        with self._lock:
            if not self._binding.initialized:  # monitoring sees an unbound manager: no blocks yet
                return pb.KVCacheStats(instance_id=self._binding.instance_id)
            stats = self._binding.manager().stats()
        return self._stats_pb(stats)

    def CheckIntegrity(self, request: pb.CheckIntegrityRequest,
                       context: grpc.ServicerContext) -> pb.CheckIntegrityResponse:
        with self._lock:
            self._binding.manager().check_integrity()
        return pb.CheckIntegrityResponse(ok=True)

    def SubscribeEvents(self, request: pb.SubscribeEventsRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.KVEventBatch]:
        # NOTE: subscribing under the manager lock means no operation is half-published:
        # the subscriber sees every event of every operation that starts after this point.
        yield from serve_events(self._hub, self._lock, self._max_subscribers, context, convert.batch_to_pb)

    def GetCachedBlocks(self, request: pb.GetCachedBlocksRequest,
                        context: grpc.ServicerContext) -> pb.GetCachedBlocksResponse:
        # NOTE: read under the manager lock, which every publishing operation holds, so the
        # hashes are exactly the state after batch `seq` and before batch `seq + 1`.
        with self._lock:
            hashes = self._binding.manager().cached_block_hashes() if self._binding.initialized else ()
            snapshot = CachedBlocks(self._hub.seq, hashes)
        return convert.cached_blocks_to_pb(snapshot, self._binding.instance_id)

    def close(self) -> None:
        """Ends every event stream cleanly (called when the server begins to stop)."""
        self._hub.close()
