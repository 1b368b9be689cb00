"""The DRAM tier: whole blocks in one preallocated byte slab, evicted in LRU order.

::

    slab: [num_slots, slot_bytes] uint8     (pinned when the pool is on a GPU)
    lru:  OrderedDict hash -> DramEntry     (head = least recently used)

The slab is allocated once per block size, so saving a block is a single copy into memory that
is already mapped (no allocator call, no page faults after the first use of a slot). A block
evicted to make room is handed to the ``demote`` sink *before* its slot is reused, which is how
evicting from DRAM moves the block to disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash


@dataclass(frozen=True)
class DramEntry:
    """One block held in DRAM."""

    block_hash: BlockHash
    fmt: BlockFormat
    slot: int


# Receives evicted blocks while their bytes are still intact: (hash, format, row view) each.
DemoteSink = Callable[[list[tuple[BlockHash, BlockFormat, torch.Tensor]]], None]
# Told of every change of the held set: (stored, hashes); the store's event journal.
ChangeListener = Callable[[bool, Sequence[BlockHash]], None]


class DramTier:
    """LRU of whole blocks within a byte budget.

    Args:
        capacity_bytes: the budget; it holds ``capacity_bytes // slot_bytes`` blocks.
        demote: where evicted blocks go (the disk tier); called before their slots are reused.
        on_change: told of every block that enters or leaves the tier (the offload events).
    """

    def __init__(self, capacity_bytes: int, demote: DemoteSink, on_change: ChangeListener | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._demote = demote
        self._on_change = on_change
        self._slab = torch.empty((0, 0), dtype=torch.uint8)
        self._pinned = False
        self._lru: OrderedDict[BlockHash, DramEntry] = OrderedDict()
        self._free: list[int] = []

    @property
    def slot_bytes(self) -> int:
        """Bytes of one block (0 until configured)."""
        return int(self._slab.shape[1])

    @property
    def num_slots(self) -> int:
        """Blocks the budget holds (0 disables the tier)."""
        return int(self._slab.shape[0])

    @property
    def used_bytes(self) -> int:
        """Bytes held by stored blocks."""
        return len(self._lru) * self.slot_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[BlockHash]:
        """Hashes from least to most recently used."""
        return iter(self._lru)

    def configure(self, slot_bytes: int, pin: bool) -> None:
        """Sizes the slab for blocks of ``slot_bytes``; a change demotes every held block first."""
        if slot_bytes == self.slot_bytes and pin == self._pinned:
            return
        self._evict(list(self._lru))
        num_slots = self.capacity_bytes // slot_bytes if slot_bytes > 0 else 0
        # NOTE: torch.empty does not touch the pages; memory is committed as slots are first used.
        slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)
        self._slab = slab.pin_memory() if pin and num_slots > 0 else slab
        self._pinned = pin
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def peek(self, block_hash: BlockHash) -> DramEntry | None:
        """The entry for ``block_hash`` without changing the LRU order."""
        return self._lru.get(block_hash)

    def get(self, block_hash: BlockHash) -> DramEntry | None:
        """The entry for ``block_hash``, marked most recently used."""
        entry = self._lru.get(block_hash)
        if entry is not None:
            self._lru.move_to_end(block_hash)
        return entry

    def row(self, entry: DramEntry) -> torch.Tensor:
        """The entry's bytes: a contiguous ``[slot_bytes]`` view into the slab."""
        return self._slab[entry.slot]

    def reserve(self, keys: Sequence[tuple[BlockHash, BlockFormat]],
                protect: Collection[BlockHash] = ()) -> list[torch.Tensor] | None:
        """Slots for new blocks (most recently used), evicting the least recently used as needed.

        An existing entry under the same hash is replaced. The caller fills the returned rows.

        Args:
            keys: (hash, format) of each new block.
            protect: hashes that must not be evicted to make room (e.g. blocks later in the same
                load: promoting one block must not push out the next one).

        Returns:
            The rows, or None (and nothing changed) when too few unprotected blocks can be evicted.

        Raises:
            ValueError: a format whose size is not the slot size.
        """
        for _, fmt in keys:
            if fmt.nbytes != self.slot_bytes:
                raise ValueError(f"block of {fmt.nbytes} bytes in {self.slot_bytes}-byte slots")
        if len(keys) > self.num_slots:
            return None
        new = {h for h, _ in keys}
        need = len(keys) - len(self._free) - sum(1 for h in new if h in self._lru)  # replaced: freed
        victims: list[BlockHash] = []
        for h in self._lru:  # least recently used first
            if len(victims) >= need:
                break
            if h not in protect and h not in new:
                victims.append(h)
        if len(victims) < need:
            return None
        for block_hash, _ in keys:
            self.discard(block_hash)
        self._evict(victims)
        rows = []
        for block_hash, fmt in keys:
            entry = DramEntry(block_hash, fmt, self._free.pop())
            self._lru[block_hash] = entry
            rows.append(self._slab[entry.slot])
        if self._on_change is not None:
            self._on_change(True, [h for h, _ in keys])
        return rows

    def discard(self, block_hash: BlockHash) -> bool:
        """Drops a block without demoting it (e.g. its bytes failed verification)."""
        entry = self._lru.pop(block_hash, None)
        if entry is None:
            return False
        self._free.append(entry.slot)
        if self._on_change is not None:
            self._on_change(False, [block_hash])
        return True

    def _evict(self, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        victims = [self._lru.pop(h) for h in hashes]
        if self._on_change is not None:
            self._on_change(False, list(hashes))
        try:  # demote while the bytes are intact; only then do the slots become free
            self._demote([(v.block_hash, v.fmt, self._slab[v.slot]) for v in victims])
        finally:  # a failed demotion loses cached copies, never slots
            self._free.extend(v.slot for v in victims)
