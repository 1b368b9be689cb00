"""The kv-cache-manager as its one caller (the scheduler) sees it: a Protocol and its two adapters.

``KVCacheBackend`` is what the step planner needs: one call per step, a free outside steps, the
binding. :class:`RemoteKVCache` is it over gRPC (the suite); :class:`InProcessKVCache` is it over
the core in the same process (the in-process engine, the scheduler's unit tests), so the same
scheduling code runs in both modes.

Errors over gRPC surface as ``grpc.RpcError`` except the one that means "this manager is not the
one we bound": ``FAILED_PRECONDITION`` (restarted: not initialized; or another owner) becomes
:class:`shared.errors.FailedPrecondition`, which the engine answers by re-binding
(docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import grpc

from services.kv_cache_manager import convert
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import (
    AllocationSpec,
    CachedBlocks,
    KVCacheStats,
    KVEventBatch,
    StepResult,
)
from shared.channels import open_channel
from shared.errors import FailedPrecondition
from shared.event_stream import EventStreamClient
from shared.ownership import OWNER_METADATA
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from shared.telemetry import instrument_grpc_client

# How long a keep-alive waits for a restarted manager to be reachable before it counts as down.
PROBE_SECONDS = 2.0


class KVCacheBackend(Protocol):
    """The kv-cache-manager as the scheduler sees it: one call per step."""

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        """Frees (rolling back ``rollback_request_ids``), then allocates in order (``AllocateSlots``)."""
        ...

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        """Frees requests outside a step (idle engine, requests refused after allocation)."""
        ...

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        """Binds the manager to this scheduler: the runner's geometry and pool incarnation. Every live
        request is freed; returns whether the cache was kept.

        Raises:
            FailedPrecondition: another scheduler still owns the manager.
        """
        ...

    def keepalive(self) -> None:
        """Renews this scheduler's ownership while idle (raises FailedPrecondition when lost)."""
        ...


class InProcessKVCache:
    """Over a :class:`KVCacheManager` core in this process (no gRPC, no owner: one process).

    ``manager`` may be None: the first :meth:`initialize` then creates it, as a bare
    kv-cache-manager service waits for its scheduler's ``Initialize``.
    """

    def __init__(self, manager: KVCacheManager | None = None) -> None:
        self.manager = manager

    @classmethod
    def from_config(cls, config: CacheConfig) -> InProcessKVCache:
        """A bound core for ``config`` (tests that drive the scheduler without an engine)."""
        return cls(KVCacheManager(config))

    def _bound(self) -> KVCacheManager:
        if self.manager is None:
            raise FailedPrecondition("not initialized: initialize() with the runner's geometry first")
        return self.manager

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        return self._bound().step(free_request_ids, allocations, rollback_request_ids)

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        return self.step(request_ids, [], rollback_request_ids).stats

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        if self.manager is None:
            self.manager = KVCacheManager(config)
            return False
        _, kept, _ = self.manager.initialize(config, keep_cache=True)
        return kept

    def keepalive(self) -> None:
        return None


@contextmanager
def _precondition_as_error() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise FailedPrecondition(f"kv-cache-manager: {exc.details()}") from exc
        raise


class RemoteKVCache:
    """The kv-cache-manager over gRPC: one ``AllocateSlots`` call per step.

    Args:
        address: ``host:port``.
        timeout: deadline of each call.
        owner_id: this scheduler incarnation, sent as ``kvmesh-owner`` metadata on every call.
        lease_seconds: how long the manager keeps this owner without a call.
    """

    def __init__(self, address: str, timeout: float = 60.0, owner_id: str = "",
                 lease_seconds: float = 10.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))
        self.stub = pb_grpc.KVCacheManagerStub(self.channel)
        self.timeout = timeout
        self.metadata = ((OWNER_METADATA, owner_id),)
        self.lease_seconds = lease_seconds
        self.instance_id = ""  # the manager process last bound

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        request = pb.AllocateSlotsRequest(free_request_ids=list(free_request_ids),
                                          allocations=[convert.spec_to_pb(a) for a in allocations],
                                          rollback_request_ids=list(rollback_request_ids))
        with _precondition_as_error():
            resp = self.stub.AllocateSlots(request, timeout=self.timeout, metadata=self.metadata)
        if resp.stats.instance_id != self.instance_id:  # cannot happen unless bound elsewhere
            raise FailedPrecondition(f"kv-cache-manager instance {resp.stats.instance_id} is not the one bound")
        return convert.step_from_pb(resp)

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        with _precondition_as_error():
            resp = self.stub.Free(pb.FreeRequest(request_ids=list(request_ids),
                                                 rollback_request_ids=list(rollback_request_ids)),
                                  timeout=self.timeout, metadata=self.metadata)
        return convert.stats_from_pb(resp.stats)

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        with _precondition_as_error():
            resp = self.stub.Initialize(convert.config_to_pb(config, pool_id, self.lease_seconds),
                                        timeout=self.timeout, metadata=self.metadata)
        self.instance_id = resp.stats.instance_id
        return bool(resp.kept_cache)

    def keepalive(self) -> None:
        # An owner call renews the lease; it waits briefly for a restarted manager to be reachable.
        with _precondition_as_error():
            self.stub.Free(pb.FreeRequest(), timeout=min(self.timeout, PROBE_SECONDS), metadata=self.metadata,
                           wait_for_ready=True)

    def release(self) -> None:
        """Clean exit: frees this scheduler's requests and ends its ownership at once."""
        self.stub.Release(pb.ReleaseRequest(), timeout=self.timeout, metadata=self.metadata)

    def stats(self) -> KVCacheStats:
        """Current pool statistics."""
        return convert.stats_from_pb(self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout))

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()


class KVEventStream(EventStreamClient[KVEventBatch, CachedBlocks]):
    """A subscriber's view of a kv-cache-manager: ``SubscribeEvents`` and the ``GetCachedBlocks``
    snapshot, as the core's dataclasses (the router's ``EventSource``)."""

    def __init__(self, stub: pb_grpc.KVCacheManagerStub, timeout: float) -> None:
        super().__init__(
            lambda: stub.SubscribeEvents(pb.SubscribeEventsRequest()), convert.batch_from_pb,
            lambda t: convert.cached_blocks_from_pb(stub.GetCachedBlocks(pb.GetCachedBlocksRequest(), timeout=t)),
            timeout)
