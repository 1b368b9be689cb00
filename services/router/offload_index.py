"""What each replica's offload-store holds, per tier, and how far past the pool match it reaches.

One :class:`~services.router.index.PrefixIndex` per tier (``dram``, ``disk``, ``remote``), keyed
by replica id, fed by the replica's offload-store events (services/offload_store/events.py)
through the same subscribe-snapshot-batches rule as the pool (services/router/events.py,
:class:`OffloadSink`). Every store batch is applied to all three tier indexes under its number
(a tier it does not touch gets an empty batch), so each keeps the one sequence and a gap in
one is a gap in all.

:meth:`OffloadIndex.extend` answers the scorer's question: past the ``pool`` blocks a replica
already holds, how many more of the request's leading blocks would its offload lookup find, and
in which tier, asking in the store's own order (DRAM, then disk, then remote): a chain of loads
stops at the first block no tier holds. DRAM and disk count only the replica's own store; the
remote tier is shared by every replica (one Redis), so a block any store reported there counts
for every replica that has an offload-store. That view is approximate by nature (docs/mesh.md):
Redis evicts without telling anyone, so a credited remote block can be a miss, which is a
recompute on that replica, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from services.kv_cache_manager.types import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from services.offload_store.types import TIERS, OffloadEventBatch, StoredBlocks
from services.router.index import PrefixIndex
from services.router.types import OffloadMatch


class OffloadIndex:
    """Per-tier block holders of every replica's offload-store."""

    def __init__(self) -> None:
        self.tiers: dict[str, PrefixIndex] = {t: PrefixIndex() for t in TIERS}

    def apply(self, replica_id: str, batch: OffloadEventBatch) -> bool:
        """Applies one store batch to every tier; False (nothing applied) on a gap."""
        per_tier: dict[str, list[KVEvent]] = {t: [] for t in TIERS}
        for e in batch.events:
            per_tier[e.tier].append(BlockStored(e.block_hashes, None, 0, 0, ()) if e.stored
                                    else BlockRemoved(e.block_hashes))
        first, *rest = TIERS  # the tiers share one sequence: the first one decides
        if not self.tiers[first].apply(replica_id, KVEventBatch(batch.seq, tuple(per_tier[first]))):
            return False
        for t in rest:
            self.tiers[t].apply(replica_id, KVEventBatch(batch.seq, tuple(per_tier[t])))
        return True

    def replace(self, replica_id: str, snapshot: StoredBlocks) -> None:
        """Sets the replica's entries of every tier to a snapshot of its store."""
        for t, index in self.tiers.items():
            index.replace(replica_id, snapshot.tier(t), snapshot.seq)

    def clear_replica(self, replica_id: str) -> None:
        """Forgets the replica's store (stream down, replica dropped) until its next snapshot."""
        for index in self.tiers.values():
            index.clear_replica(replica_id)

    def last_seq(self, replica_id: str) -> int:
        """The last store batch applied for ``replica_id``."""
        return self.tiers[TIERS[0]].last_seq(replica_id)

    def blocks(self, replica_id: str, tier: str) -> frozenset[bytes]:
        """A copy of the hashes the replica's store reported in ``tier``."""
        return self.tiers[tier].blocks(replica_id)

    def extend(self, hashes: Sequence[bytes], pool: Mapping[str, int],
               with_store: Collection[str]) -> dict[str, OffloadMatch]:
        """Per replica of ``with_store``: the blocks past its pool match its store would load, by tier.

        Args:
            hashes: the request's block hashes, in chain order.
            pool: each replica's pool match (leading blocks held in its pool; missing: 0).
            with_store: the replicas whose offload-store the router follows.
        """
        if not with_store or not hashes:
            return {}
        dram = self.tiers["dram"].holders(hashes)
        disk = self.tiers["disk"].holders(hashes)
        remote = self.tiers["remote"].holders(hashes)
        out: dict[str, OffloadMatch] = {}
        for rid in with_store:
            counts = {"dram": 0, "disk": 0, "remote": 0}
            for i in range(min(pool.get(rid, 0), len(hashes)), len(hashes)):
                if rid in dram[i]:
                    counts["dram"] += 1
                elif rid in disk[i]:
                    counts["disk"] += 1
                elif remote[i]:  # any replica's store put it there: one shared Redis
                    counts["remote"] += 1
                else:
                    break
            out[rid] = OffloadMatch(**counts)
        return out


class OffloadSink:
    """One replica's entries in the :class:`OffloadIndex` (an :class:`~services.router.events.EventFeed` sink)."""

    def __init__(self, index: OffloadIndex, replica_id: str) -> None:
        self._index = index
        self._id = replica_id

    def apply(self, batch: OffloadEventBatch) -> bool:
        return self._index.apply(self._id, batch)

    def replace(self, snapshot: StoredBlocks) -> None:
        self._index.replace(self._id, snapshot)

    def clear(self) -> None:
        self._index.clear_replica(self._id)

    def last_seq(self) -> int:
        return self._index.last_seq(self._id)
