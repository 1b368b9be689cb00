"""Event fan-out: each subscriber gets its own bounded queue of numbered event batches.

One implementation for every service that publishes change events (the kv-cache-manager's pool,
the offload-store's tiers). The publisher never blocks on a subscriber: one that falls
``max_pending`` batches behind is dropped (``overflowed``), because a consumer with holes in its
view (a prefix-aware router) must resynchronise rather than silently go wrong. Batch numbers are
global per hub, so a resubscriber can tell how much it missed.

Thread-safe: publishers run on gRPC worker threads while each subscriber's stream reads from another.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

E = TypeVar("E")
B = TypeVar("B")


class Subscription(Generic[B]):
    """One subscriber's queue; iterate it to receive batches until it is closed."""

    def __init__(self, hub: EventHub[object, B], max_pending: int) -> None:
        self._hub = hub
        self._max_pending = max_pending
        self._queue: deque[B] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.overflowed = False

    def offer(self, batch: B) -> bool:
        """Queues ``batch``; closes the subscription instead of blocking when it is full.

        Returns:
            False when the subscription is (now) closed and should be dropped.
        """
        with self._cond:
            if self._closed:
                return False
            if len(self._queue) >= self._max_pending:
                self.overflowed = True
                self._closed = True
            else:
                self._queue.append(batch)
            self._cond.notify_all()
            return not self._closed

    def get(self, timeout: float | None = None) -> B | None:
        """The next batch; None once closed and drained, or when ``timeout`` passes first."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue) or self._closed, timeout)
            if self._queue:
                return self._queue.popleft()
            return None

    @property
    def closed(self) -> bool:
        """True once closed (by the subscriber, the hub, or an overflow)."""
        return self._closed

    def close(self) -> None:
        """Ends the subscription; batches already queued can still be read."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._hub.unsubscribe(self)

    def __iter__(self) -> Iterator[B]:
        """Blocks for each batch; ends when closed and drained."""
        while True:
            batch = self.get()
            if batch is None:
                return
            yield batch


class EventHub(Generic[E, B]):
    """Fan-out of event batches to the current subscribers.

    Args:
        make_batch: builds the batch type from its number and events (e.g. ``KVEventBatch``).
        max_pending: batches a subscriber may have unread before it is dropped.
    """

    def __init__(self, make_batch: Callable[[int, tuple[E, ...]], B], max_pending: int = 1024) -> None:
        self._make_batch = make_batch
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._subscribers: list[Subscription[B]] = []
        self._seq = 0

    @property
    def num_subscribers(self) -> int:
        """Current subscriptions."""
        return len(self._subscribers)

    @property
    def seq(self) -> int:
        """The number of the last batch published (0 before the first)."""
        with self._lock:
            return self._seq

    @property
    def has_subscribers(self) -> bool:
        """Whether events are worth producing at all (a racy read is fine: see subscribe)."""
        return bool(self._subscribers)

    def subscribe(self) -> Subscription[B]:
        """A new subscription receiving every batch published from now on.

        NOTE: callers that need "every event after subscribe returns" must not publish
        concurrently (the servicers subscribe under their core's lock).
        """
        sub: Subscription[B] = Subscription(self, self._max_pending)  # type: ignore[arg-type]
        with self._lock:
            self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription[B]) -> None:
        """Stops delivering to ``sub`` (idempotent)."""
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def publish(self, events: Sequence[E]) -> None:
        """Delivers ``events`` as one batch to every subscriber; nothing when empty."""
        if not events:
            return
        with self._lock:
            # NOTE: delivered under the lock so that concurrent publishers cannot interleave
            # and hand a subscriber batches out of seq order.
            self._seq += 1
            batch = self._make_batch(self._seq, tuple(events))
            self._subscribers = [sub for sub in self._subscribers if sub.offer(batch)]

    def close(self) -> None:
        """Ends every subscription (server shutdown): their streams finish cleanly."""
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub.close()


class EventStreamEnded(Exception):
    """An event stream or its snapshot call failed (the wire's reason in the message).

    Here, beside the hub, so a subscriber's core (the router's resync rule) can catch it without
    importing the gRPC clients that raise it (the kv-cache-manager's and the offload-store's).
    """
