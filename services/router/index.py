"""The global prefix index: block hash -> the replicas whose pool holds it, fed by KV events.

Each replica's kv-cache-manager streams ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
in numbered batches. The index starts a replica from a snapshot of its pool (:meth:`replace`,
with the batch number it includes), applies later batches in order and refuses a batch whose
number is not the next one (a gap: the stream lost something), so the caller resyncs from a
new snapshot instead of routing on a view with holes (services/router/events.py).

Predictions (``predict``): a routed request's hashes count as held by its replica from the
decision on, until that replica's events store them (or a timeout passes: the request was
refused, failed, or never got that far). Without them every request of a burst is decided
before the first prefill's events arrive, so a burst of one prefix scatters like round-robin;
with them the second request already follows the first (the SGLang router's insert-on-route,
Dynamo's approximate mode). Predictions are kept apart from the events' view: :meth:`blocks`
and :meth:`num_blocks` are the replica's real pool, only :meth:`match` counts both.

NOTE: a replica's pool serves one block per hash (a duplicate computed concurrently stays
unregistered and produces no event), so a set per replica mirrors it exactly.

Thread-safe: one event thread per replica writes while request threads match.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from services.kv_cache_manager.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class PrefixIndex:
    """Which replica holds which block hash, and the last batch applied per replica."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._last_seq: dict[str, int] = {}
        self._predicted: dict[str, dict[bytes, float]] = {}  # replica -> hash -> until (clock)

    def apply(self, replica_id: str, batch: KVEventBatch) -> bool:
        """Applies one batch; False (and nothing applied) when it does not follow the last one.

        The first batch after :meth:`clear_replica` may carry any number: a subscription starts
        at the hub's current number, and what came before it is unknown either way.
        """
        with self._lock:
            last = self._last_seq.get(replica_id)
            if last is not None and batch.seq != last + 1:
                return False
            mine = self._blocks.setdefault(replica_id, set())
            predicted = self._predicted.get(replica_id, {})
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        mine.add(h)
                        self._holders.setdefault(h, set()).add(replica_id)
                        predicted.pop(h, None)  # confirmed
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        self._drop(replica_id, h)
                        mine.discard(h)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(replica_id)
                    mine = self._blocks.setdefault(replica_id, set())
            self._last_seq[replica_id] = batch.seq
            return True

    def replace(self, replica_id: str, hashes: Iterable[bytes], seq: int) -> None:
        """Sets a replica's entries to a snapshot of its pool taken after batch ``seq``.

        The next batch applied must be ``seq + 1`` (the caller skips streamed batches up to ``seq``).
        """
        with self._lock:
            self._clear(replica_id)
            mine = self._blocks.setdefault(replica_id, set())
            for h in hashes:
                mine.add(h)
                self._holders.setdefault(h, set()).add(replica_id)
            self._last_seq[replica_id] = seq

    def clear_replica(self, replica_id: str) -> None:
        """Forgets everything about a replica (stream down, replica dropped) until its next snapshot."""
        with self._lock:
            self._clear(replica_id)
            self._last_seq.pop(replica_id, None)
            self._predicted.pop(replica_id, None)

    def predict(self, replica_id: str, hashes: Iterable[bytes], seconds: float) -> None:
        """Counts ``hashes`` as held by ``replica_id`` in :meth:`match` until its events store them, or ``seconds``."""
        with self._lock:
            now = self._clock()
            until = now + seconds
            mine = self._blocks.get(replica_id, set())
            predicted = {h: t for h, t in self._predicted.get(replica_id, {}).items() if t > now}
            for h in hashes:
                if h not in mine:
                    predicted[h] = until
            self._predicted[replica_id] = predicted

    def _clear(self, replica_id: str) -> None:
        for h in self._blocks.pop(replica_id, set()):
            self._drop(replica_id, h)

    def _drop(self, replica_id: str, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[block_hash]

    def unpredict(self, replica_id: str, hashes: Iterable[bytes]) -> None:
        """Withdraws predictions of ``hashes`` on ``replica_id`` (the request went elsewhere)."""
        with self._lock:
            predicted = self._predicted.get(replica_id)
            if predicted:
                for h in hashes:
                    predicted.pop(h, None)

    def match(self, hashes: Sequence[bytes], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica, how many leading ``hashes`` it holds or is predicted to hold.

        The chain stops at a replica's first miss.
        """
        with self._lock:
            now = self._clock()
            result = dict.fromkeys(replica_ids, 0)
            alive = set(result)
            predicted = {r: p for r in alive if (p := self._predicted.get(r))}
            for i, h in enumerate(hashes):
                holders = self._holders.get(h, set())
                for rid in [r for r in alive if r not in holders and predicted.get(r, {}).get(h, 0.0) <= now]:
                    result[rid] = i
                    alive.discard(rid)
                if not alive:
                    return result
            for rid in alive:
                result[rid] = len(hashes)
            return result

    def holders(self, hashes: Sequence[bytes]) -> list[frozenset[str]]:
        """Per hash, the replicas whose events hold it (predictions not counted), in one lock."""
        with self._lock:
            return [frozenset(self._holders.get(h, ())) for h in hashes]

    def blocks(self, replica_id: str) -> frozenset[bytes]:
        """A copy of the hashes held for ``replica_id``."""
        with self._lock:
            return frozenset(self._blocks.get(replica_id, ()))

    def num_blocks(self, replica_id: str) -> int:
        """How many hashes the index holds for ``replica_id``."""
        with self._lock:
            return len(self._blocks.get(replica_id, ()))

    def last_seq(self, replica_id: str) -> int:
        """The last batch applied for ``replica_id`` (0 before the first)."""
        with self._lock:
            return self._last_seq.get(replica_id, 0)
