"""gRPC adapter of the offload-store: protobuf in, core call under one lock, protobuf out.

Only hashes, block ids and counters cross this boundary; KV bytes move through the mapped pool.

Ownership (docs/reliability.md): ``AttachPool`` makes the caller's ``kvmesh-owner`` the owner
(refused while another owner's lease runs); ``Save``, ``Load`` and ``Release`` are the owner's
only, so nobody who merely reaches the port can overwrite or read another scheduler's cached KV.
``Lookup`` (whether given hashes are stored: no KV moves, and a hash needs the deployment's seed)
and ``GetStats`` (aggregates) stay open.
"""

from __future__ import annotations

import threading
from typing import Any

from services.offload_store.store import OffloadStoreCore
from services.offload_store.types import OffloadStats
from shared.grpc_server import ServiceName
from shared.metrics import OffloadMetrics
from shared.ownership import Lease, owner_from_metadata
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc
from shared.tensor_handle import handle_from_proto


def _blocks(refs: Any) -> list[tuple[bytes, int]]:
    return [(r.block_hash, r.block_id) for r in refs]

SERVICE = ServiceName.of("offload-store", offload_store_pb2, "OffloadStore")


class OffloadStoreServicer(offload_store_pb2_grpc.OffloadStoreServicer):
    """Serialises every call on one lock: the core, its index and the pool mapping are not
    thread-safe, and the grpc server runs handlers on a thread pool."""

    def __init__(self, core: OffloadStoreCore, metrics: OffloadMetrics | None = None,
                 default_lease_seconds: float = 10.0) -> None:
        self._core = core
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

    def AttachPool(self, request: offload_store_pb2.AttachPoolRequest, context: Any
                   ) -> offload_store_pb2.AttachPoolResponse:
        handle = handle_from_proto(request.pool)
        owner = owner_from_metadata(context.invocation_metadata())
        with self._lock:
            self._lease.acquire(owner, request.lease_seconds or self._default_lease)
            nbytes = self._core.attach_pool(handle)
            self._export()
        return offload_store_pb2.AttachPoolResponse(bytes_per_block=nbytes)

    def Release(self, request: offload_store_pb2.ReleaseOffloadRequest, context: Any
                ) -> offload_store_pb2.ReleaseOffloadResponse:
        with self._lock:
            self._lease.release(owner_from_metadata(context.invocation_metadata()))
            self._core.detach_pool()
            self._export()
        return offload_store_pb2.ReleaseOffloadResponse()

    def Lookup(self, request: offload_store_pb2.LookupRequest, context: Any
               ) -> offload_store_pb2.LookupResponse:
        with self._lock:
            results = [self._core.lookup(list(chain.block_hashes)) for chain in request.chains]
        return offload_store_pb2.LookupResponse(num_present=[r.num_present for r in results],
                                                num_in_dram=[r.num_in_dram for r in results])

    def Save(self, request: offload_store_pb2.SaveRequest, context: Any) -> offload_store_pb2.SaveResponse:
        with self._lock:
            self._owned(context)
            try:
                result = self._core.save(_blocks(request.blocks))
            finally:
                self._export()
        return offload_store_pb2.SaveResponse(num_saved=result.num_saved, num_skipped=result.num_skipped)

    def Load(self, request: offload_store_pb2.LoadRequest, context: Any) -> offload_store_pb2.LoadResponse:
        with self._lock:
            self._owned(context)
            try:
                result = self._core.load(_blocks(request.blocks))
            finally:
                self._export()
        return offload_store_pb2.LoadResponse(num_loaded=result.num_loaded,
                                              failed_hashes=result.failed_hashes)

    def GetStats(self, request: offload_store_pb2.GetOffloadStatsRequest, context: Any
                 ) -> offload_store_pb2.OffloadStats:
        with self._lock:
            s = self._core.stats()
        return offload_store_pb2.OffloadStats(
            dram_blocks=s.dram_blocks, dram_bytes=s.dram_bytes, dram_capacity_bytes=s.dram_capacity_bytes,
            disk_blocks=s.disk_blocks, disk_bytes=s.disk_bytes, disk_capacity_bytes=s.disk_capacity_bytes,
            dram_hits=s.dram_hits, disk_hits=s.disk_hits, misses=s.misses, saves=s.saves,
            corruptions=s.corruptions, pool_attached=s.pool_attached, pool_generation=s.pool_generation,
            refused_no_pool=s.refused_no_pool,
        )
