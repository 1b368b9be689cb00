"""KV event fan-out of the kv-cache-manager: shared/event_hub.py's hub, for pool events.

The manager publishes one batch per operation (a step, a free, a reset); a subscriber that
falls behind is dropped and must resynchronise (the router's snapshot rule).
"""

from __future__ import annotations

from services.kv_cache_manager.types import KVEvent, KVEventBatch
from shared.event_hub import EventHub as _Hub
from shared.event_hub import Subscription as _Subscription

Subscription = _Subscription[KVEventBatch]


class EventHub(_Hub[KVEvent, KVEventBatch]):
    """The pool's hub: batches are :class:`KVEventBatch`.

    Args:
        max_pending: batches a subscriber may have unread before it is dropped.
    """

    def __init__(self, max_pending: int = 1024) -> None:
        super().__init__(KVEventBatch, max_pending)
