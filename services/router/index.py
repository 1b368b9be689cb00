"""The global prefix index: block hash -> the replicas whose pool holds it, fed by KV events.

Each replica's kv-cache-manager streams ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
in numbered batches. The index starts a replica from a snapshot of its pool (:meth:`replace`,
with the batch number it includes), applies later batches in order and refuses a batch whose
number is not the next one (a gap: the stream lost something), so the caller resyncs from a
new snapshot instead of routing on a view with holes (services/router/events.py).

NOTE: a replica's pool serves one block per hash (a duplicate computed concurrently stays
unregistered and produces no event), so a set per replica mirrors it exactly.

Thread-safe: one event thread per replica writes while request threads match.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from services.kv_cache_manager.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class PrefixIndex:
    """Which replica holds which block hash, and the last batch applied per replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._last_seq: dict[str, int] = {}

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
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        mine.add(h)
                        self._holders.setdefault(h, set()).add(replica_id)
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

    def _clear(self, replica_id: str) -> None:
        for h in self._blocks.pop(replica_id, set()):
            self._drop(replica_id, h)

    def _drop(self, replica_id: str, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[block_hash]

    def match(self, hashes: Sequence[bytes], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica, how many leading ``hashes`` it holds (the chain stops at the first miss)."""
        with self._lock:
            result = dict.fromkeys(replica_ids, 0)
            alive = set(result)
            for i, h in enumerate(hashes):
                holders = self._holders.get(h, set())
                for rid in [r for r in alive if r not in holders]:
                    result[rid] = i
                    alive.discard(rid)
                if not alive:
                    return result
            for rid in alive:
                result[rid] = len(hashes)
            return result

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
