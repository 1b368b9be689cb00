"""Both ends of an event subscription over gRPC, written once for every service that publishes.

The kv-cache-manager (pool blocks) and the offload-store (tier blocks) publish the same way: a
server stream of numbered batches from a :class:`shared.event_hub.EventHub`, opened with an
initial-metadata handshake (sent once the subscriber is registered, so nothing published after
that point is missed), plus a snapshot RPC the subscriber resyncs from. :func:`serve_events` is
the servicer's half, :class:`EventStreamClient` the subscriber's; each service only supplies its
stub methods and converters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import grpc

from shared.errors import ResourceExhausted
from shared.event_hub import EventHub, EventStreamEnded

Batch = TypeVar("Batch")
Snapshot = TypeVar("Snapshot")
# Sent once the subscriber is registered: a client that has read it misses nothing published later.
SUBSCRIBED_METADATA = (("kvmesh-subscribed", "1"),)


def serve_events(hub: EventHub[Any, Any], lock: threading.Lock, max_subscribers: int, context: grpc.ServicerContext,
                 to_pb: Callable[[Any], Any]) -> Iterator[Any]:
    """A ``SubscribeEvents`` handler's body: register, handshake, stream batches until either side ends.

    Args:
        lock: the service's one lock, which every publishing operation holds: subscribing under it
            means no operation is half-published to this stream.

    Raises:
        ResourceExhausted: ``max_subscribers`` already subscribed, or this one fell behind and was
            dropped (it resubscribes and resyncs from the snapshot).
    """
    with lock:
        if hub.num_subscribers >= max_subscribers:
            raise ResourceExhausted(f"at most {max_subscribers} event subscribers; retry later")
        sub = hub.subscribe()
    if not context.add_callback(sub.close):  # the client is already gone
        sub.close()
        return
    context.send_initial_metadata(SUBSCRIBED_METADATA)
    try:
        for batch in sub:
            yield to_pb(batch)
    finally:
        sub.close()
    if sub.overflowed:
        raise ResourceExhausted("event subscriber fell behind and was dropped; resubscribe")


class EventStreamClient(Generic[Batch, Snapshot]):
    """A subscriber's view of one publisher: the stream (one open at a time) and the snapshot, as
    the publisher's dataclasses; every wire failure is an :class:`EventStreamEnded` (the router's
    ``EventSource``).

    Args:
        open_stream: calls the stub's ``SubscribeEvents`` (returns the call).
        batch_from_pb: one streamed message -> the publisher's batch dataclass.
        get_snapshot: calls the stub's snapshot RPC with a timeout, converted to the dataclass.
        timeout: deadline of the snapshot call (the stream itself has none: it lives until cut).
    """

    def __init__(self, open_stream: Callable[[], Any], batch_from_pb: Callable[[Any], Batch],
                 get_snapshot: Callable[[float], Snapshot], timeout: float) -> None:
        self._open = open_stream
        self._from_pb = batch_from_pb
        self._get_snapshot = get_snapshot
        self._timeout = timeout
        self._call: Any = None
        self._cancelled = False

    def subscribe(self) -> Iterator[Batch]:
        """Opens the stream and waits for its initial metadata (sent once the subscriber is registered)."""
        try:
            call = self._open()
        except ValueError as exc:  # the channel was closed under us (the replica was dropped)
            raise EventStreamEnded("channel closed") from exc
        self._call = call
        if self._cancelled:
            call.cancel()
        call.initial_metadata()  # returns on failure too: the iteration below raises then
        return self._batches(call)

    def _batches(self, call: Any) -> Iterator[Batch]:
        try:
            for msg in call:
                yield self._from_pb(msg)
        except grpc.RpcError as exc:
            raise EventStreamEnded(str(exc.code())) from exc

    def snapshot(self) -> Snapshot | None:
        """The publisher's current blocks and batch number; None from one that predates the RPC."""
        try:
            return self._get_snapshot(self._timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise EventStreamEnded(f"snapshot: {exc.code()}") from exc
        except ValueError as exc:  # the channel was closed under us
            raise EventStreamEnded("channel closed") from exc

    def cancel(self) -> None:
        """Cuts the open stream; after :meth:`close` (cancelled for good) new ones are cut at once too."""
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Cancels for good (the feed is stopping)."""
        self._cancelled = True
        self.cancel()
