"""The replicas as the router reaches them: scheduler stubs, health/stats probes, event streams.

Each replica gets two daemon threads:

- a probe loop: every ``health_interval_seconds``, the scheduler's ``grpc.health.v1`` check and
  the kv-cache-manager's GetStats (KV usage). A replica that does not answer is skipped by the
  scorer until it answers again.
- an event feed (services/router/events.py): SubscribeEvents, then a snapshot of the pool
  (GetCachedBlocks) that replaces the replica's index entries, then every later batch; on a
  gap, an overflow or a broken stream it resyncs the same way (with exponential backoff while
  the replica is unreachable), so the index equals the pool again after each.

A replica whose address names its offload-store gets a third thread: the same feed on the
store's tier events (GetStoredBlocks, then batches) into the offload index.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.kv_cache_manager.client import KVEventStream
from services.offload_store.client import OffloadEventStream
from services.offload_store.types import OffloadEventBatch, StoredBlocks
from services.router import discovery
from services.router.config import RouterConfig
from services.router.discovery import DiscoveryDiff, GetAddrInfo
from services.router.events import EventFeed, PoolSink
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.offload_index import OffloadIndex, OffloadSink
from services.router.types import ReplicaAddress, ReplicaLoad
from shared.channels import open_channel
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc
from shared.pb.kvmesh.v1 import offload_store_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from shared.telemetry import instrument_grpc_client

log = logging.getLogger(__name__)
Metadata = tuple[tuple[str, str | bytes], ...]


class Replica:
    """One replica: its stubs, what the probes last saw, the streams the router has open on it."""

    def __init__(self, address: ReplicaAddress, config: RouterConfig, index: PrefixIndex,
                 metrics: RouterMetrics | None = None, offload: OffloadIndex | None = None) -> None:
        self.address = address
        self.id = address.id
        self._config = config
        self._index = index
        self._offload = offload
        self._metrics = metrics
        self.channel = instrument_grpc_client(open_channel(address.scheduler_address))
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._kvm_channel = open_channel(address.kvm_address)
        self._kvm = kvm_grpc.KVCacheManagerStub(self._kvm_channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.healthy = False
        self.kv_usage = 0.0
        self.info: scheduler_pb2.SchedulerModelInfo | None = None
        self._in_flight = 0
        self._feed = EventFeed(self.id, KVEventStream(self._kvm, config.rpc_timeout_seconds), config,
                               PoolSink(index, self.id), metrics, self._forget_model)
        self._threads = [threading.Thread(target=self._probe_loop, name=f"router-probe-{self.id}", daemon=True),
                         threading.Thread(target=self._feed.run, name=f"router-events-{self.id}", daemon=True)]
        self._offload_channel: grpc.Channel | None = None
        self._offload_feed: EventFeed[OffloadEventBatch, StoredBlocks] | None = None
        if address.offload_address and offload is not None:
            self._offload_channel = open_channel(address.offload_address)
            stream = OffloadEventStream(offload_store_pb2_grpc.OffloadStoreStub(self._offload_channel),
                                        config.rpc_timeout_seconds)
            self._offload_feed = EventFeed(self.id, stream, config, OffloadSink(offload, self.id), metrics,
                                           kind="offload")
            self._threads.append(threading.Thread(target=self._offload_feed.run, name=f"router-offload-{self.id}",
                                                  daemon=True))

    def start(self) -> None:
        """Starts the probe and event threads."""
        for t in self._threads:
            t.start()

    @property
    def subscribed(self) -> bool:
        """Whether its event stream is open and the index follows it."""
        return self._feed.subscribed

    @property
    def has_offload(self) -> bool:
        """Whether the router follows this replica's offload-store (its tiers count in the score)."""
        return self._offload_feed is not None

    @property
    def offload_subscribed(self) -> bool:
        """Whether its offload-store's event stream is open and the offload index follows it."""
        return self._offload_feed is not None and self._offload_feed.subscribed

    @property
    def offload_subscriptions(self) -> int:
        """Offload-store event streams opened so far."""
        return self._offload_feed.subscriptions if self._offload_feed is not None else 0

    @property
    def subscriptions(self) -> int:
        """Event streams opened so far (each one resynced the index from a snapshot)."""
        return self._feed.subscriptions

    def _forget_model(self) -> None:
        self.info = None  # a restarted replica may serve another model: ask again

    @property
    def in_flight(self) -> int:
        """Generate streams open on this replica now."""
        return self._in_flight

    def load(self) -> ReplicaLoad:
        """What the scorer weighs."""
        return ReplicaLoad(self._in_flight, self.kv_usage)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Counts one open Generate stream for as long as the block runs."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def mark_failed(self) -> None:
        """A forwarded call found it unreachable: skip it until the next probe answers."""
        self.healthy = False
        if self._metrics is not None:
            self._metrics.healthy.labels(self.id).set(0)

    # ------------------------------------------------------------------ probes

    def probe(self) -> None:
        """One health + stats probe (also run once synchronously at start).

        NOTE: the scheduler's health service is open, but its API needs a caller's key, so the
        model info (model id, block size) is fetched with the first caller's metadata instead
        (:meth:`model_info`).
        """
        timeout = self._config.rpc_timeout_seconds
        try:
            health = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            stats = self._kvm.GetStats(kvm_pb2.GetStatsRequest(), timeout=timeout)
            self.kv_usage = (stats.num_blocks - stats.num_free_blocks) / stats.num_blocks if stats.num_blocks else 0.0
            self.healthy = health.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            if self.healthy:
                log.warning("router: replica %s unreachable: %s", self.id, exc.code())
            self.healthy = False
        if self._metrics is not None:
            self._metrics.healthy.labels(self.id).set(1 if self.healthy else 0)
            self._metrics.indexed_blocks.labels(self.id).set(self._index.num_blocks(self.id))
            if self._offload is not None and self.has_offload:
                for tier, index in self._offload.tiers.items():
                    self._metrics.offload_indexed.labels(self.id, tier).set(index.num_blocks(self.id))

    def model_info(self, metadata: Metadata) -> scheduler_pb2.SchedulerModelInfo:
        """The replica's model info, asked once with the caller's metadata, then kept until it reconnects."""
        info = self.info
        if info is None:
            info = self.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), metadata=metadata,
                                          timeout=self._config.rpc_timeout_seconds)
            self.info = info
        return info

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._config.health_interval_seconds):
            self.probe()

    def stop(self) -> None:
        """Stops the probe and event threads; the channels stay open (calls on them still end with a status)."""
        self._stop.set()
        self._feed.stop()
        if self._offload_feed is not None:
            self._offload_feed.stop()

    def close(self) -> None:
        """Stops the threads and closes the channels."""
        self.stop()
        self._kvm_channel.close()
        if self._offload_channel is not None:
            self._offload_channel.close()
        self.channel.close()


class ReplicaSet:
    """The replicas the router routes to: the configured list, or what DNS discovery finds.

    ``replicas`` and ``by_id`` are replaced (never mutated) when discovery adds or drops one, so a
    reader holding the old list or dict keeps a consistent view.
    """

    def __init__(self, config: RouterConfig, index: PrefixIndex, metrics: RouterMetrics | None = None,
                 getaddrinfo: GetAddrInfo = socket.getaddrinfo, offload: OffloadIndex | None = None) -> None:
        self._config = config
        self._index = index
        self._offload = offload
        self._metrics = metrics
        self._target = config.discovery_target()
        self._getaddrinfo = getaddrinfo
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replicas: list[Replica] = [Replica(a, config, index, metrics, offload)
                                        for a in config.replica_addresses()]
        self.by_id: dict[str, Replica] = {r.id: r for r in self.replicas}
        # Dropped replicas, closed one discovery round later: a request that chose one just before
        # it was dropped gets UNAVAILABLE from its open channel (and fails over), not a closed channel.
        self._retired: list[Replica] = []
        self._discovery = threading.Thread(target=self._discovery_loop, name="router-discovery", daemon=True)

    def start(self) -> None:
        """Probes each replica once, then starts their threads (and the discovery loop, if any)."""
        for r in self.replicas:
            r.probe()
            r.start()
        if self._target is not None:
            self.discover()
            self._discovery.start()

    def discover(self) -> DiscoveryDiff:
        """One DNS resolution: starts the new replicas, closes vanished unhealthy ones (their index too)."""
        assert self._target is not None
        retired, self._retired = self._retired, []
        for r in retired:
            r.close()
        current = self.replicas
        change = discovery.diff(discovery.resolve(self._target, self._getaddrinfo), [r.id for r in current],
                                [r.id for r in current if r.healthy], self._target)
        if not change.added and not change.removed:
            return change
        fresh = [Replica(a, self._config, self._index, self._metrics, self._offload) for a in change.added]
        for r in fresh:
            r.probe()
        with self._lock:
            gone = [r for r in self.replicas if r.id in change.removed]
            self.replicas = [r for r in self.replicas if r.id not in change.removed] + fresh
            self.by_id = {r.id: r for r in self.replicas}
        for r in fresh:
            r.start()
        for r in gone:
            r.stop()
            self._index.clear_replica(r.id)
            if self._offload is not None:
                self._offload.clear_replica(r.id)
        self._retired.extend(gone)
        log.info("router: discovery via %s: added %s, removed %s", self._target.name,
                 [a.id for a in change.added] or "-", list(change.removed) or "-")
        return change

    def _discovery_loop(self) -> None:
        assert self._target is not None
        while not self._stop.wait(self._config.discovery_interval_seconds):
            self.discover()

    def wait_ready(self, timeout: float) -> bool:
        """Waits until there is a replica and every one is healthy and subscribed; False on ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.replicas
            if current and all(r.healthy and r.subscribed and (r.offload_subscribed or not r.has_offload)
                               for r in current):
                return True
            time.sleep(0.05)
        return False

    def healthy(self) -> list[Replica]:
        """The replicas to route to now."""
        return [r for r in self.replicas if r.healthy]

    def model_info(self, candidates: list[Replica], metadata: Metadata) -> scheduler_pb2.SchedulerModelInfo:
        """The served model's info (every replica serves the same model): a cached one, else asked."""
        for r in candidates:
            if r.info is not None:
                return r.info
        last: grpc.RpcError | None = None
        for r in candidates:
            try:
                return r.model_info(metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                r.mark_failed()
                last = exc
        raise last if last is not None else RuntimeError("no candidate replica")

    def close(self) -> None:
        """Stops discovery and every replica's threads and channels."""
        self._stop.set()
        for r in [*self.replicas, *self._retired]:
            r.close()
