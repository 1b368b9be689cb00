"""The offload-store's tier events: what each verb changed in DRAM, disk and remote, as one batch.

The tiers report every change through a listener (a block entered or left them); this journal
collects one store operation's changes in order and publishes them as one numbered batch on
the hub (shared/event_hub.py) when the operation ends, so a subscriber never sees half a save.
The servicer runs every operation, the snapshot and each subscription under its one lock, which
makes "subscribe, snapshot, then batches numbered above the snapshot's" exact, as for the pool.

The remote tier is shared by every replica, and Redis evicts on its own (``maxmemory``), so no
store can list it. What a store reports is what it knows: blocks it wrote or found already
there on a save, blocks served to it, and blocks it found missing on a lookup or load. That
view is kept bounded (``remote_blocks``, least recently confirmed dropped first, with a removed
event) so a long-lived store does not grow without limit. A router crediting a remote block
that Redis has since evicted gets a miss, which is a recompute, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from services.offload_store.types import OffloadEventBatch, StoredBlocks, TierEvent
from shared.event_hub import EventHub
from shared.hashing import BlockHash

# What a tier calls on a change: (stored, hashes). The store binds the tier's name.
TierListener = Callable[[bool, Sequence[BlockHash]], None]


class OffloadEventHub(EventHub[TierEvent, OffloadEventBatch]):
    """The store's hub: batches are :class:`OffloadEventBatch`."""

    def __init__(self, max_pending: int = 1024) -> None:
        super().__init__(OffloadEventBatch, max_pending)


class TierJournal:
    """Collects tier changes and publishes them per operation; owns the remote view.

    Args:
        hub: where batches go.
        remote_blocks: most remote hashes remembered (0: remote residency is not reported).
    """

    def __init__(self, hub: OffloadEventHub, remote_blocks: int) -> None:
        self.hub = hub
        self._remote_blocks = remote_blocks
        self._pending: list[TierEvent] = []
        self._remote: OrderedDict[BlockHash, None] = OrderedDict()

    def listener(self, tier: str) -> TierListener:
        """The callback a local tier reports its changes through."""
        return lambda stored, hashes: self.record(tier, stored, hashes)

    def record(self, tier: str, stored: bool, hashes: Iterable[BlockHash]) -> None:
        """Queues one change (merged into the previous event when it is the same tier and kind)."""
        hs = tuple(hashes)
        if not hs:
            return
        last = self._pending[-1] if self._pending else None
        if last is not None and last.tier == tier and last.stored == stored:
            self._pending[-1] = TierEvent(tier, stored, last.block_hashes + hs)
        else:
            self._pending.append(TierEvent(tier, stored, hs))

    def remote_seen(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` are in the remote tier now (written, found there, or served)."""
        if self._remote_blocks <= 0:
            return
        new = []
        for h in hashes:
            if h in self._remote:
                self._remote.move_to_end(h)
            else:
                self._remote[h] = None
                new.append(h)
        self.record("remote", True, new)
        dropped = []
        while len(self._remote) > self._remote_blocks:
            dropped.append(self._remote.popitem(last=False)[0])
        self.record("remote", False, dropped)

    def remote_gone(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` were found missing from the remote tier (evicted, expired, corrupt)."""
        gone = [h for h in hashes if h in self._remote]
        for h in gone:
            del self._remote[h]
        self.record("remote", False, gone)

    def flush(self) -> None:
        """Publishes the queued changes as one batch (nothing when there are none)."""
        if self._pending:
            events, self._pending = self._pending, []
            self.hub.publish(events)

    def snapshot(self, dram: Iterable[BlockHash], disk: Iterable[BlockHash]) -> StoredBlocks:
        """Every tier's hashes and the last batch they include (call between operations)."""
        self.flush()
        return StoredBlocks(self.hub.seq, tuple(dram), tuple(disk), tuple(self._remote))
