"""The offload-store as its callers see it: one Protocol, a gRPC adapter and an in-process adapter.

The scheduler's offload policy (``services/scheduler/offload.py``) is written against
:class:`OffloadBackend` only, so the same policy runs over the service (:class:`RemoteOffload`,
``kvmesh serve``) and over the core in the scheduler's process (:class:`InProcessOffload`, tests
and benchmarks). Callers import this module and ``types.py``, never the core: the in-process
adapter builds its core from an :class:`OffloadConfig` itself.

Re-attach (docs/reliability.md): a restarted store has no pool mapped and no owner, so it refuses
the owner's calls with ``FAILED_PRECONDITION``; :class:`RemoteOffload` answers that by attaching
the runner's last pool again and retrying the call once, so saves resume instead of silently
stopping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from services.offload_store import convert
from services.offload_store.config import OffloadConfig
from services.offload_store.types import OffloadEventBatch, OffloadStats, StoredBlocks
from shared.channels import open_channel
from shared.event_stream import EventStreamClient
from shared.ownership import OWNER_METADATA
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc
from shared.telemetry import instrument_grpc_client

if TYPE_CHECKING:
    from services.offload_store.store import OffloadStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class OffloadBackend(Protocol):
    """The verbs the scheduler uses (blocks are ``(block hash, pool block id)`` pairs)."""

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Per chain, the leading hashes the store holds (all new requests of a step at once)."""
        ...

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Copies pool blocks into the store; returns how many were written."""
        ...

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Copies stored blocks into pool blocks in order; returns how many leading ones succeeded."""
        ...

    def attach(self, handle: Any) -> None:
        """Maps the runner's (current) pool in the store and makes this scheduler its owner."""
        ...

    def keepalive(self) -> None:
        """Renews this scheduler's ownership of the store while idle."""
        ...


class InProcessOffload:
    """The core in this process: no gRPC, no owner (one process has one scheduler)."""

    def __init__(self, config: OffloadConfig) -> None:
        from services.offload_store.store import OffloadStore  # NOTE: here: the event client needs no torch

        self.core: OffloadStore = OffloadStore(config)

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        return [self.core.lookup(list(c)).num_present for c in chains]

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return self.core.save(list(blocks)).num_saved

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return self.core.load(list(blocks)).num_loaded

    def attach(self, handle: Any) -> None:
        self.core.attach_pool(handle)

    def keepalive(self) -> None:
        return None

    def stats(self) -> OffloadStats:
        """The core's counters (tests and benchmarks read them)."""
        return self.core.stats()

    def close(self) -> None:
        """Closes the core: unmaps the pool, closes the index."""
        self.core.close()


class RemoteOffload:
    """The offload-store over gRPC (hashes and block ids only; bytes move through shared memory).

    Args:
        address: ``host:port`` of the store.
        timeout: deadline of each call.
        owner_id: this scheduler incarnation (sent as ``kvmesh-owner`` metadata on every call).
        lease_seconds: how long the store keeps this owner without a call.
    """

    def __init__(self, address: str, timeout: float = 30.0, owner_id: str = "",
                 lease_seconds: float = 10.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))  # short reconnect backoff: shared.channels
        self.stub = offload_store_pb2_grpc.OffloadStoreStub(self.channel)
        self.timeout = timeout
        self._metadata = ((OWNER_METADATA, owner_id),)
        self._lease_seconds = lease_seconds
        self._handle: Any = None  # the last pool attached, re-attached after a store restart

    def _call(self, method: Callable[..., T], request: Any) -> T:
        """One call; a FAILED_PRECONDITION (restarted store: no pool, no owner) re-attaches the
        current pool and retries once."""
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or self._handle is None:
                raise
            log.warning("offload-store refused a call (%s); re-attaching the KV pool", exc.details())
        self.attach(self._handle)
        return method(request, timeout=self.timeout, metadata=self._metadata)

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        results = convert.lookup_results_from_pb(self._call(self.stub.Lookup, convert.lookup_to_pb(chains)))
        return [r.num_present for r in results]

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return convert.saved_from_pb(self._call(self.stub.Save, convert.save_to_pb(blocks))).num_saved

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return convert.loaded_from_pb(self._call(self.stub.Load, convert.load_to_pb(blocks))).num_loaded

    def attach(self, handle: Any) -> None:
        """Has the store map the runner's pool (a ``SharedTensorHandle``, dataclass or proto)."""
        self._handle = handle
        self.stub.AttachPool(convert.attach_to_pb(handle, self._lease_seconds),
                             timeout=self.timeout, metadata=self._metadata)

    def keepalive(self) -> None:
        # An empty Save is an owner call (renews the lease) that a restarted store refuses: re-attach.
        self._call(self.stub.Save, convert.save_to_pb([]))

    def stats(self) -> OffloadStats:
        """The store's counters (an open call: no owner needed)."""
        msg = self.stub.GetStats(offload_store_pb2.GetOffloadStatsRequest(), timeout=self.timeout)
        return convert.stats_from_pb(msg)

    def release(self) -> None:
        """Clean exit: ends this scheduler's ownership so a successor attaches at once."""
        self.stub.Release(offload_store_pb2.ReleaseOffloadRequest(), timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()


class OffloadEventStream(EventStreamClient[OffloadEventBatch, StoredBlocks]):
    """A subscriber's view of an offload-store: ``SubscribeEvents`` and the ``GetStoredBlocks``
    snapshot, as the core's dataclasses (the router's ``EventSource``, like the kv-cache-manager's
    ``KVEventStream``)."""

    def __init__(self, stub: offload_store_pb2_grpc.OffloadStoreStub, timeout: float) -> None:
        super().__init__(
            lambda: stub.SubscribeEvents(offload_store_pb2.SubscribeOffloadEventsRequest()),
            convert.event_batch_from_pb,
            lambda t: convert.stored_blocks_from_pb(stub.GetStoredBlocks(offload_store_pb2.GetStoredBlocksRequest(),
                                                                         timeout=t)),
            timeout)
