"""The scheduler's side of the offload-store: look up, load and save blocks by hash, never failing a request.

Policy (see docs/offload.md):

* **save on evict** — the kv-cache-manager reports every cached block whose slot a step reuses;
  the scheduler saves those blocks to the store *before* the step runs, so a prefix that falls out
  of the pool is still one copy away;
* **load instead of recompute** — for a new request, the store's longest run of the prompt's block
  hashes is offered to the kv-cache-manager as ``num_external_blocks``; blocks past the pool hit
  are allocated, filled by the store through shared memory, and only the rest is prefilled;
* **swap preemption** (``preemption_mode=swap``) — a preempted request's full blocks are saved
  eagerly before they are freed;
* **faults** — store down, a load error, a checksum mismatch: the affected blocks are recomputed
  (the request's answer never changes) and a counter records it;
* **re-attach** — a restarted store has no pool mapped and no owner: the remote adapter answers
  the resulting ``FAILED_PRECONDITION`` by attaching the runner's current pool again and retrying
  the call once, so saves resume instead of silently stopping (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from shared.channels import open_channel
from shared.ownership import OWNER_METADATA
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc
from shared.telemetry import instrument_grpc_client

log = logging.getLogger(__name__)
T = TypeVar("T")


class OffloadBackend(Protocol):
    """The three verbs the scheduler uses."""

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Per chain, the leading hashes the store holds (all new requests of a step at once)."""
        ...

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Copies (hash, pool block id) blocks into the store; returns how many were written."""
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


@dataclass
class OffloadCounters:
    """What the connector did, for metrics and the benchmark."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_failures: int = 0  # blocks that had to be recomputed after a failed load
    errors: int = 0  # calls that raised (store down, timeouts)
    attach_failures: int = 0  # AttachPool calls that failed (the store then saves nothing)


class OffloadConnector:
    """Wraps a backend so that any failure degrades to a miss, and counts everything."""

    def __init__(self, backend: OffloadBackend) -> None:
        self.backend = backend
        self.counters = OffloadCounters()

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Per chain, the leading blocks available; all 0 on any error."""
        if not any(chains):
            return [0] * len(chains)
        self.counters.lookups += 1
        try:
            found = self.backend.lookup(chains)
        except Exception as exc:
            self._error("lookup", exc)
            return [0] * len(chains)
        self.counters.hit_blocks += sum(found)
        return found

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Best effort: a failed save only loses a future hit."""
        if not blocks:
            return
        try:
            self.counters.saved_blocks += self.backend.save(blocks)
        except Exception as exc:
            self._error("save", exc)

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Leading blocks loaded; the rest must be recomputed."""
        if not blocks:
            return 0
        try:
            n = self.backend.load(blocks)
        except Exception as exc:
            self._error("load", exc)
            n = 0
        self.counters.loaded_blocks += n
        self.counters.load_failures += len(blocks) - n
        return n

    def attach(self, handle: Any) -> bool:
        """Attaches the store to the runner's pool; False (logged, counted) when it cannot."""
        try:
            self.backend.attach(handle)
        except Exception as exc:
            self.counters.attach_failures += 1
            log.error("offload-store cannot attach the KV pool, offload is off until it can: %s", exc)
            return False
        return True

    def keepalive(self) -> None:
        """Best effort: a lost store ownership is re-taken on the next call's re-attach."""
        try:
            self.backend.keepalive()
        except Exception as exc:
            self._error("keepalive", exc)

    def _error(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        log.warning("offload %s failed, treating as a miss: %s", what, exc)


class InProcessOffload:
    """Adapter over an in-process ``OffloadStore``."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        return [int(self.core.lookup(list(c)).num_present) for c in chains]

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return int(self.core.save(list(blocks)).num_saved)

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return int(self.core.load(list(blocks)).num_loaded)

    def attach(self, handle: Any) -> None:
        self.core.attach_pool(handle)

    def keepalive(self) -> None:
        return None


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

    @staticmethod
    def _refs(blocks: Sequence[tuple[bytes, int]]) -> list[offload_store_pb2.BlockRef]:
        return [offload_store_pb2.BlockRef(block_hash=h, block_id=b) for h, b in blocks]

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
        req = offload_store_pb2.LookupRequest(chains=[offload_store_pb2.HashChain(block_hashes=c) for c in chains])
        return list(self._call(self.stub.Lookup, req).num_present)

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return int(self._call(self.stub.Save, offload_store_pb2.SaveRequest(blocks=self._refs(blocks))).num_saved)

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        return int(self._call(self.stub.Load, offload_store_pb2.LoadRequest(blocks=self._refs(blocks))).num_loaded)

    def attach(self, handle: Any) -> None:
        """Has the store map the runner's pool (``handle`` is a ``SharedTensorHandle`` proto)."""
        self._handle = handle
        self.stub.AttachPool(offload_store_pb2.AttachPoolRequest(pool=handle, lease_seconds=self._lease_seconds),
                             timeout=self.timeout, metadata=self._metadata)

    def keepalive(self) -> None:
        # An empty Save is an owner call (renews the lease) that a restarted store refuses: re-attach.
        self._call(self.stub.Save, offload_store_pb2.SaveRequest())

    def release(self) -> None:
        """Clean exit: ends this scheduler's ownership so a successor attaches at once."""
        self.stub.Release(offload_store_pb2.ReleaseOffloadRequest(), timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()
