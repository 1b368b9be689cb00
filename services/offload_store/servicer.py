"""gRPC adapter of the offload-store: ``convert`` in, core call under one lock, ``convert`` out.

Only hashes, block ids and counters cross this boundary; KV bytes move through the mapped pool.

Ownership (docs/reliability.md): ``AttachPool`` makes the caller's ``kvmesh-owner`` the owner
(refused while another owner's lease runs); ``Save``, ``Load`` and ``Release`` are the owner's
only, so nobody who merely reaches the port can overwrite or read another scheduler's cached KV.
``Lookup`` (whether given hashes are stored: no KV moves, and a hash needs the deployment's seed),
``GetStats`` (aggregates), ``SubscribeEvents`` and ``GetStoredBlocks`` (hashes per tier, for a
router's index) stay open.

Events: every core call runs under the one lock and publishes its batch before releasing it,
and a subscription is registered under the same lock, so "subscribe, then snapshot, then the
batches numbered above the snapshot's" is exact (the router's resync, services/router/events.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from services.offload_store import convert
from services.offload_store.metrics import OffloadMetrics
from services.offload_store.store import OffloadStore
from services.offload_store.types import OffloadStats
from shared.event_stream import serve_events
from shared.grpc_server import ServiceName
from shared.ownership import Lease, owner_from_metadata
from shared.pb.kvmesh.v1 import offload_store_pb2 as pb
from shared.pb.kvmesh.v1 import offload_store_pb2_grpc

SERVICE = ServiceName.of("offload-store", pb, "OffloadStore")
# Initial metadata of a registered SubscribeEvents stream (the same as the kv-cache-manager's).


class OffloadStoreServicer(offload_store_pb2_grpc.OffloadStoreServicer):
    """Serialises every call on one lock: the core, its index and the pool mapping are not
    thread-safe, and the grpc server runs handlers on a thread pool."""

    def __init__(self, core: OffloadStore, metrics: OffloadMetrics | None = None,
                 default_lease_seconds: float = 10.0, max_subscribers: int = 4) -> None:
        self._core = core
        self._max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._metrics = metrics
        self._seen = OffloadStats()
        self._lease = Lease("the offload-store", "AttachPool")
        self._default_lease = default_lease_seconds
        if metrics is not None:
            metrics.pool_attached.set(0)

    def _owned(self, context: Any) -> None:
        """Refuses a caller that is not the owner (under the lock); renews the owner's lease."""
        self._lease.check(owner_from_metadata(context.invocation_metadata()))

    def _export(self) -> None:
        """Mirrors the core's counters into Prometheus (by delta; called under the lock)."""
        if self._metrics is None:
            return
        s, old, m = self._core.stats(), self._seen, self._metrics
        m.hit("dram", s.dram_hits - old.dram_hits)
        m.hit("disk", s.disk_hits - old.disk_hits)
        m.save("dram", s.saves - old.saves)
        m.corruption("disk", s.corruptions - old.corruptions)
        m.miss(s.misses - old.misses)
        m.set_stored_bytes("dram", s.dram_bytes)
        m.set_stored_bytes("disk", s.disk_bytes)
        m.refused_no_pool.inc(s.refused_no_pool - old.refused_no_pool)
        m.pool_attached.set(int(s.pool_attached))
        self._seen = s

    def AttachPool(self, request: pb.AttachPoolRequest, context: Any) -> pb.AttachPoolResponse:
        handle, lease_seconds = convert.attach_from_pb(request)
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            self._lease.acquire(owner, lease_seconds or self._default_lease)
            nbytes = self._core.attach_pool(handle)
            self._export()
        return convert.attached_to_pb(nbytes)

    def Release(self, request: pb.ReleaseOffloadRequest, context: Any) -> pb.ReleaseOffloadResponse:
        with self._lock:
            self._lease.release(owner_from_metadata(context.invocation_metadata()))
            self._core.detach_pool()
            self._export()
        return pb.ReleaseOffloadResponse()

    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        chains = convert.lookup_from_pb(request)
        with self._lock:
            results = [self._core.lookup(chain) for chain in chains]
        return convert.lookup_results_to_pb(results)

    def Save(self, request: pb.SaveRequest, context: Any) -> pb.SaveResponse:
        blocks = convert.save_from_pb(request)
        with self._lock:
            self._owned(context)
            try:
                result = self._core.save(blocks)
            finally:
                self._export()
        return convert.saved_to_pb(result)

    def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:
        blocks = convert.load_from_pb(request)
        with self._lock:
            self._owned(context)
            try:
                result = self._core.load(blocks)
            finally:
                self._export()
        return convert.loaded_to_pb(result)

    def GetStats(self, request: pb.GetOffloadStatsRequest, context: Any) -> pb.OffloadStats:
        with self._lock:
            stats = self._core.stats()
        return convert.stats_to_pb(stats)

    def SubscribeEvents(self, request: pb.SubscribeOffloadEventsRequest,
                        context: Any) -> Iterator[pb.OffloadEventBatch]:
        # under the one lock: no operation is half-published, every later one reaches this stream
        yield from serve_events(self._core.hub, self._lock, self._max_subscribers, context,
                                convert.event_batch_to_pb)

    def GetStoredBlocks(self, request: pb.GetStoredBlocksRequest, context: Any) -> pb.GetStoredBlocksResponse:
        with self._lock:
            snap = self._core.stored_blocks()
        return convert.stored_blocks_to_pb(snap)
