"""One replica's KV event feed into the index: subscribe, snapshot, then every later batch.

The resync protocol (docs/mesh.md "The global prefix index"):

1. ``SubscribeEvents``; its initial metadata means the stream is registered, so every batch
   published from now on will reach us.
2. ``GetCachedBlocks``: the pool's hashes and the number ``seq`` of the last batch they include
   (read under the kv-cache-manager's lock, which every publishing operation holds).
3. The replica's entries are **replaced** by the snapshot; streamed batches numbered ``<= seq``
   are skipped (already in it), each later one is applied in order.

A gap in the batch numbers, an overflow (the manager dropped us) or a broken stream (a restart)
starts again from 1: after a reconnect the index equals the pool, not just what was stored
since. A broken stream clears the replica's entries until the next snapshot, since the index
must never claim blocks of a replica it cannot see; a gap keeps them until the snapshot that
follows at once. A kv-cache-manager without the snapshot RPC
(``UNIMPLEMENTED``, an older build during a rolling upgrade) is followed as before: cleared and
relearned from new events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from services.kv_cache_manager.types import CachedBlocks, EventStreamEnded, KVEventBatch
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class EventSource(Protocol):
    """A replica's kv-cache-manager as the feed needs it (over gRPC: the kv-cache-manager's ``KVEventStream``)."""

    def subscribe(self) -> Iterator[KVEventBatch]:
        """Opens a stream; returns once it is registered. Iterating raises EventStreamEnded on a failure."""

    def snapshot(self) -> CachedBlocks | None:
        """The pool's hashes and batch number; None when the replica has no snapshot RPC."""

    def cancel(self) -> None:
        """Ends the open stream, if any (from another thread)."""

    def close(self) -> None:
        """Ends the open stream and every later one (the feed is stopping)."""


class EventFeed:
    """Keeps ``index``'s entries for one replica equal to its pool, across gaps and restarts.

    Args:
        replica_id: the index key.
        source: the replica's kv-cache-manager.
        on_subscribed: called after each (re)subscription is in place (the replica forgets what a
            restart may have changed, e.g. its model info).
    """

    def __init__(self, replica_id: str, source: EventSource, config: RouterConfig,
                 index: PrefixIndex, metrics: RouterMetrics | None, on_subscribed: Callable[[], None]) -> None:
        self._id = replica_id
        self._source = source
        self._config = config
        self._index = index
        self._metrics = metrics
        self._on_subscribed = on_subscribed
        self._stop = threading.Event()
        self.subscribed = False
        self.subscriptions = 0

    def _sync(self) -> int:
        """Replaces the replica's entries by its snapshot; returns the last batch number it includes."""
        snap = self._source.snapshot()
        if snap is None:  # an older kv-cache-manager: relearn from new events
            self._index.clear_replica(self._id)
            return -1
        self._index.replace(self._id, snap.block_hashes, snap.seq)
        return snap.seq

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
            if not self._index.apply(self._id, batch):
                log.warning("router: replica %s event gap after batch %d (got %d): resyncing",
                            self._id, self._index.last_seq(self._id), batch.seq)
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
                    log.info("router: replica %s event stream ended (%s): resyncing", self._id, exc)
            finally:
                self.subscribed = False
            if self._stop.is_set():
                return
            if reason == "disconnect":  # until the next snapshot, claim nothing we cannot see
                self._index.clear_replica(self._id)  # (a gap resyncs at once: the old view stays till then)
            if self._metrics is not None:
                self._metrics.resyncs.labels(self._id, reason).inc()
            if self.subscriptions > subscriptions:
                backoff = cfg.reconnect_min_seconds  # it was up: retry at once-ish
            if reason != "gap":
                self._stop.wait(backoff)
                backoff = min(backoff * 2, cfg.reconnect_max_seconds)

    def stop(self) -> None:
        """Ends the feed (the current stream is cancelled)."""
        self._stop.set()
        self._source.close()
