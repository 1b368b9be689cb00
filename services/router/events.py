"""One event feed into the router's index: subscribe, snapshot, then every later batch.

Two kinds of feed follow this one rule: each replica's kv-cache-manager (its pool, into
:class:`~services.router.index.PrefixIndex` through :class:`PoolSink`) and, where the replica
names one, its offload-store (its DRAM, disk and remote tiers, into
:class:`~services.router.offload_index.OffloadIndex`). The resync protocol (docs/mesh.md "The
global prefix index"):

1. ``SubscribeEvents``; its initial metadata means the stream is registered, so every batch
   published from now on will reach us.
2. The snapshot RPC (``GetCachedBlocks`` / ``GetStoredBlocks``): the hashes and the number
   ``seq`` of the last batch they include (read under the service's lock, which every
   publishing operation holds).
3. The replica's entries are **replaced** by the snapshot; streamed batches numbered ``<= seq``
   are skipped (already in it), each later one is applied in order.

A gap in the batch numbers, an overflow (the service dropped us) or a broken stream (a restart)
starts again from 1: after a reconnect the index equals the service's state, not just what
changed since. A broken stream clears the replica's entries until the next snapshot, since the
index must never claim blocks of a replica it cannot see; a gap keeps them until the snapshot
that follows at once. A service without the snapshot RPC (``UNIMPLEMENTED``, an older build
during a rolling upgrade) is followed as before: cleared and relearned from new events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from services.kv_cache_manager.types import CachedBlocks, KVEventBatch
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from shared.event_hub import EventStreamEnded

log = logging.getLogger(__name__)


class Numbered(Protocol):
    """A batch: its number is all the feed reads."""

    @property
    def seq(self) -> int: ...


B = TypeVar("B", bound=Numbered)
S = TypeVar("S")
B_co = TypeVar("B_co", bound=Numbered, covariant=True)
S_co = TypeVar("S_co", covariant=True)
B_contra = TypeVar("B_contra", bound=Numbered, contravariant=True)
S_contra = TypeVar("S_contra", contravariant=True)


class EventSource(Protocol[B_co, S_co]):
    """A replica's service as the feed needs it (over gRPC: ``KVEventStream``, ``OffloadEventStream``)."""

    def subscribe(self) -> Iterator[B_co]:
        """Opens a stream; returns once it is registered. Iterating raises EventStreamEnded on a failure."""

    def snapshot(self) -> S_co | None:
        """The state's hashes and batch number; None when the service has no snapshot RPC."""

    def cancel(self) -> None:
        """Ends the open stream, if any (from another thread)."""

    def close(self) -> None:
        """Ends the open stream and every later one (the feed is stopping)."""


class FeedSink(Protocol[B_contra, S_contra]):
    """Where one feed's view lives: one replica's entries in an index."""

    def apply(self, batch: B_contra) -> bool:
        """Applies a batch; False (nothing applied) when it does not follow the last one."""

    def replace(self, snapshot: S_contra) -> None:
        """Sets the entries to a snapshot (the next batch must follow its number)."""

    def clear(self) -> None:
        """Forgets the entries until the next snapshot."""

    def last_seq(self) -> int:
        """The last batch applied."""


class PoolSink:
    """One replica's pool entries in the :class:`PrefixIndex`."""

    def __init__(self, index: PrefixIndex, replica_id: str) -> None:
        self._index = index
        self._id = replica_id

    def apply(self, batch: KVEventBatch) -> bool:
        return self._index.apply(self._id, batch)

    def replace(self, snapshot: CachedBlocks) -> None:
        self._index.replace(self._id, snapshot.block_hashes, snapshot.seq)

    def clear(self) -> None:
        self._index.clear_replica(self._id)

    def last_seq(self) -> int:
        return self._index.last_seq(self._id)


class EventFeed(Generic[B, S]):
    """Keeps ``sink``'s entries for one replica equal to its service's state, across gaps and restarts.

    Args:
        name: the replica id, as logs and the resync metric name it.
        source: the replica's kv-cache-manager or offload-store.
        sink: the replica's entries in the index that service feeds.
        on_subscribed: called after each (re)subscription is in place (the replica forgets what a
            restart may have changed, e.g. its model info).
        kind: ``pool`` or ``offload`` (the resync metric's label).
    """

    def __init__(self, name: str, source: EventSource[B, S], config: RouterConfig, sink: FeedSink[B, S],
                 metrics: RouterMetrics | None, on_subscribed: Callable[[], None] = lambda: None,
                 kind: str = "pool") -> None:
        self._id = name
        self._source = source
        self._config = config
        self._sink = sink
        self._kind = kind
        self._metrics = metrics
        self._on_subscribed = on_subscribed
        self._stop = threading.Event()
        self.subscribed = False
        self.subscriptions = 0

    def _sync(self) -> int:
        """Replaces the replica's entries by its snapshot; returns the last batch number it includes."""
        snap = self._source.snapshot()
        if snap is None:  # an older service: relearn from new events
            self._sink.clear()
            return -1
        self._sink.replace(snap)
        return self._sink.last_seq()

    def _follow(self) -> str:
        """Applies the stream until it ends; the reason to resync (``gap`` or ``disconnect``)."""
        stream = self._source.subscribe()  # registered: every later batch reaches us
        base = self._sync()
        self._on_subscribed()
        self.subscribed = True
        self.subscriptions += 1
        for batch in stream:
            if batch.seq <= base:  # published before the snapshot, so already in it
                continue
            if not self._sink.apply(batch):
                log.warning("router: replica %s %s event gap after batch %d (got %d): resyncing",
                            self._id, self._kind, self._sink.last_seq(), batch.seq)
                self._source.cancel()
                return "gap"
        return "disconnect"

    def run(self) -> None:
        """The feed's thread: follow, and after any interruption resync (backing off on failures)."""
        cfg = self._config
        backoff = cfg.reconnect_min_seconds
        while not self._stop.is_set():
            reason = "disconnect"
            subscriptions = self.subscriptions
            try:
                reason = self._follow()
            except EventStreamEnded as exc:
                if not self._stop.is_set():
                    log.info("router: replica %s %s event stream ended (%s): resyncing", self._id, self._kind, exc)
            finally:
                self.subscribed = False
            if self._stop.is_set():
                return
            if reason == "disconnect":  # until the next snapshot, claim nothing we cannot see
                self._sink.clear()  # (a gap resyncs at once: the old view stays till then)
            if self._metrics is not None:
                self._metrics.resyncs.labels(self._id, reason, self._kind).inc()
            if self.subscriptions > subscriptions:
                backoff = cfg.reconnect_min_seconds  # it was up: retry at once-ish
            if reason != "gap":
                self._stop.wait(backoff)
                backoff = min(backoff * 2, cfg.reconnect_max_seconds)

    def stop(self) -> None:
        """Ends the feed (the current stream is cancelled)."""
        self._stop.set()
        self._source.close()
