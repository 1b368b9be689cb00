"""The router's gRPC adapter to a replica's kv-cache-manager events: the stream and the snapshot.

The wire half of services/router/events.py (which holds the resync rule and imports no gRPC):
protobuf -> the kv-cache-manager's own dataclasses, ``grpc.RpcError`` -> ``StreamEnded``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from services.kv_cache_manager.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlocks,
    KVEvent,
    KVEventBatch,
)
from services.router.events import StreamEnded
from shared.hashing import BlockHash
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc


def batch_from_pb(msg: kvm_pb2.KVEventBatch) -> KVEventBatch:
    """A streamed batch as the kv-cache-manager's own dataclasses (what the index consumes)."""
    events: list[KVEvent] = []
    for e in msg.events:
        kind = e.WhichOneof("event")
        if kind == "stored":
            s = e.stored
            events.append(BlockStored(tuple(BlockHash(h) for h in s.block_hashes),
                                      BlockHash(s.parent_block_hash) if s.parent_block_hash else None,
                                      s.block_size, s.num_tokens, tuple(s.block_ids)))
        elif kind == "removed":
            events.append(BlockRemoved(tuple(BlockHash(h) for h in e.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return KVEventBatch(msg.seq, tuple(events))


def snapshot_from_pb(msg: kvm_pb2.GetCachedBlocksResponse) -> CachedBlocks:
    """A ``GetCachedBlocks`` answer as the kv-cache-manager's dataclass."""
    return CachedBlocks(msg.seq, tuple(BlockHash(h) for h in msg.block_hashes))


class KVMEvents:
    """``EventSource`` over a kv-cache-manager stub (one stream open at a time).

    Args:
        timeout: deadline of the snapshot call (the stream itself has none: it lives until cut).
    """

    def __init__(self, stub: kvm_grpc.KVCacheManagerStub, timeout: float) -> None:
        self._stub = stub
        self._timeout = timeout
        self._call: grpc.CallIterator[kvm_pb2.KVEventBatch] | None = None
        self._cancelled = False

    def subscribe(self) -> Iterator[KVEventBatch]:
        """Opens SubscribeEvents and waits for its initial metadata (the manager sends it once registered)."""
        try:
            call = self._stub.SubscribeEvents(kvm_pb2.SubscribeEventsRequest())
        except ValueError as exc:  # the channel was closed under us (the replica was dropped)
            raise StreamEnded("channel closed") from exc
        self._call = call
        if self._cancelled:
            call.cancel()
        call.initial_metadata()  # returns on failure too: the iteration below raises then
        return self._batches(call)

    @staticmethod
    def _batches(call: grpc.CallIterator[kvm_pb2.KVEventBatch]) -> Iterator[KVEventBatch]:
        try:
            for msg in call:
                yield batch_from_pb(msg)
        except grpc.RpcError as exc:
            raise StreamEnded(str(exc.code())) from exc

    def snapshot(self) -> CachedBlocks | None:
        """GetCachedBlocks; None from a kv-cache-manager that predates it (UNIMPLEMENTED)."""
        try:
            return snapshot_from_pb(self._stub.GetCachedBlocks(kvm_pb2.GetCachedBlocksRequest(),
                                                               timeout=self._timeout))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise StreamEnded(f"snapshot: {exc.code()}") from exc
        except ValueError as exc:  # the channel was closed under us (the replica was dropped)
            raise StreamEnded("channel closed") from exc

    def cancel(self) -> None:
        """Cuts the open stream; after :meth:`close` (cancelled for good) new ones are cut at once too."""
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Cancels for good (the feed is stopping)."""
        self._cancelled = True
        self.cancel()
