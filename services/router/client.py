"""The replicas as the router reaches them: scheduler stubs, health/stats probes, event streams.

Each replica gets two daemon threads:

- a probe loop: every ``health_interval_seconds``, the scheduler's GetModelInfo (health, and the
  model id and block size the hashes need) and the kv-cache-manager's GetStats (KV usage). A
  replica that does not answer is skipped by the scorer until it answers again.
- an event loop: SubscribeEvents on the kv-cache-manager. Once the stream is registered (its
  initial metadata), the replica's index entries are cleared and relearned from the events that
  follow; on a gap in the batch numbers, an overflow or a broken stream, the entries are cleared
  again and the stream is re-opened with exponential backoff. Clearing loses what the replica
  held before (those prefixes miss once), but the index never claims a block the replica lacks
  for longer than a reconnect (docs/mesh.md: no snapshot RPC yet).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc

from services.kv_cache_manager.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.prefix import replica_hash_seed
from services.router.types import ReplicaAddress, ReplicaLoad
from shared.channels import open_channel
from shared.hashing import BlockHash, hash_blocks
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.telemetry import instrument_grpc_client

log = logging.getLogger(__name__)


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


class Replica:
    """One replica: its stubs, what the probes last saw, the streams the router has open on it."""

    def __init__(self, address: ReplicaAddress, config: RouterConfig, index: PrefixIndex,
                 metrics: RouterMetrics | None = None) -> None:
        self.address = address
        self.id = address.id
        self._config = config
        self._index = index
        self._metrics = metrics
        self.channel = instrument_grpc_client(open_channel(address.scheduler_address))
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._kvm_channel = open_channel(address.kvm_address)
        self._kvm = kvm_grpc.KVCacheManagerStub(self._kvm_channel)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._call: grpc.Call | None = None
        self.healthy = False
        self.subscribed = False
        self.subscriptions = 0
        self.kv_usage = 0.0
        self.info: scheduler_pb2.SchedulerModelInfo | None = None
        self.seed_checked = False
        self._in_flight = 0
        self._threads = [threading.Thread(target=self._probe_loop, name=f"router-probe-{self.id}", daemon=True),
                         threading.Thread(target=self._event_loop, name=f"router-events-{self.id}", daemon=True)]

    def start(self) -> None:
        """Starts the probe and event threads."""
        for t in self._threads:
            t.start()

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
        """One health + stats probe (also run once synchronously at start)."""
        timeout = self._config.rpc_timeout_seconds
        try:
            self.info = self.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), timeout=timeout)
            stats = self._kvm.GetStats(kvm_pb2.GetStatsRequest(), timeout=timeout)
            self.kv_usage = (stats.num_blocks - stats.num_free_blocks) / stats.num_blocks if stats.num_blocks else 0.0
            if not self.seed_checked:
                self._check_seed(self.info)
            self.healthy = True
        except grpc.RpcError as exc:
            if self.healthy:
                log.warning("router: replica %s unreachable: %s", self.id, exc.code())
            self.healthy = False
        if self._metrics is not None:
            self._metrics.healthy.labels(self.id).set(1 if self.healthy else 0)
            self._metrics.indexed_blocks.labels(self.id).set(self._index.num_blocks(self.id))

    def _check_seed(self, info: scheduler_pb2.SchedulerModelInfo) -> None:
        """Compares our hashes of a probe block with the replica's own (as the scheduler does at start)."""
        probe = list(range(info.block_size))
        theirs = list(self._kvm.LookupPrefix(kvm_pb2.LookupPrefixRequest(token_ids=probe),
                                             timeout=self._config.rpc_timeout_seconds).block_hashes)
        ours = hash_blocks(replica_hash_seed(self._config.deployment_key, info.model_id), probe, info.block_size)
        if theirs != ours:
            log.error("router: replica %s hashes prefixes with another seed: set the same KVMESH_DEPLOYMENT_KEY "
                      "for the router and every replica (its prefix hits cannot be seen)", self.id)
        self.seed_checked = True

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._config.health_interval_seconds):
            self.probe()

    # ------------------------------------------------------------------ events

    def _resync(self, reason: str) -> None:
        self._index.clear_replica(self.id)
        if self._metrics is not None:
            self._metrics.resyncs.labels(self.id, reason).inc()

    def _event_loop(self) -> None:
        cfg = self._config
        backoff = cfg.reconnect_min_seconds
        while not self._stop.is_set():
            call = self._kvm.SubscribeEvents(kvm_pb2.SubscribeEventsRequest())
            self._call = call
            reason = "disconnect"
            try:
                call.initial_metadata()  # the stream is registered: every later event reaches us
                self._index.clear_replica(self.id)
                self.subscribed = True
                self.subscriptions += 1
                backoff = cfg.reconnect_min_seconds
                for msg in call:
                    if not self._index.apply(self.id, batch_from_pb(msg)):
                        log.warning("router: replica %s event gap after batch %d (got %d): resubscribing",
                                    self.id, self._index.last_seq(self.id), msg.seq)
                        reason = "gap"
                        call.cancel()
                        break
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    log.info("router: replica %s event stream ended (%s): resubscribing", self.id, exc.code())
            finally:
                self.subscribed = False
            if self._stop.is_set():
                return
            self._resync(reason)
            if reason != "gap":
                self._stop.wait(backoff)
                backoff = min(backoff * 2, cfg.reconnect_max_seconds)

    def close(self) -> None:
        """Stops the threads and closes the channels."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._kvm_channel.close()
        self.channel.close()


class ReplicaSet:
    """Every configured replica, in configuration order."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, metrics: RouterMetrics | None = None) -> None:
        self.replicas = [Replica(a, config, index, metrics) for a in config.replica_addresses()]
        self.by_id = {r.id: r for r in self.replicas}

    def start(self) -> None:
        """Probes each replica once, then starts their threads."""
        for r in self.replicas:
            r.probe()
            r.start()

    def wait_ready(self, timeout: float) -> bool:
        """Waits until every replica is healthy and subscribed; False when ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.healthy and r.subscribed for r in self.replicas):
                return True
            time.sleep(0.05)
        return False

    def healthy(self) -> list[Replica]:
        """The replicas to route to now."""
        return [r for r in self.replicas if r.healthy]

    def model_info(self) -> scheduler_pb2.SchedulerModelInfo | None:
        """The served model's info from a healthy replica (every replica serves the same model)."""
        for r in self.healthy():
            if r.info is not None:
                return r.info
        return None

    def close(self) -> None:
        """Stops every replica's threads and channels."""
        for r in self.replicas:
            r.close()
