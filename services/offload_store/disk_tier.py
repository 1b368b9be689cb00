"""The disk tier: block files plus their index rows, within a byte budget, evicted in LRU order.

The two halves stay consistent by ordering, not by a distributed transaction:

* put:    write + fsync + rename the file  ──▶  insert the row
* evict:  delete the row                    ──▶  unlink the file

so every row names a complete file at every instant, and a crash can only leave files without
rows (orphans) or temp files, which :meth:`DiskTier.reconcile` deletes at start-up. Rows whose file
went missing or changed length (someone else's doing) are dropped there too. Checksums are verified
lazily, on read: a full scan at start-up would cost a read of the whole tier.

The LRU order lives in memory (loaded from ``last_access`` at start-up); a read hit updates it and
the row's ``last_access``, so the order survives restarts.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.offload_store.block_files import BlockFiles
from services.offload_store.index import TIER_DISK, BlockIndex, IndexRow
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash


@dataclass(frozen=True)
class ReconcileReport:
    """What start-up reconciliation repaired."""

    temp_files_removed: int = 0
    orphan_files_removed: int = 0
    rows_dropped: int = 0
    evicted_over_budget: int = 0


@dataclass(frozen=True)
class PutResult:
    """Outcome of :meth:`DiskTier.put_many`."""

    written: int  # new files
    present: int  # already on disk in the same format: nothing written
    dropped: int  # larger than the whole budget: not stored


class DiskTier:
    """Block files under ``<root>/blocks`` indexed by ``index``, within ``capacity_bytes``."""

    def __init__(self, root: str | os.PathLike[str], index: BlockIndex, capacity_bytes: int,
                 on_change: Callable[[bool, Sequence[BlockHash]], None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._on_change = on_change  # told of every block that enters or leaves (the offload events)
        self.files = BlockFiles(root)
        self._index = index
        self._lru: OrderedDict[BlockHash, IndexRow] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        """Stops the file I/O threads."""
        self.files.close()

    def get(self, block_hash: BlockHash) -> IndexRow | None:
        """The row of ``block_hash`` (no LRU update)."""
        return self._lru.get(block_hash)

    def hashes(self) -> list[BlockHash]:
        """Stored hashes, least recently used first."""
        return list(self._lru)

    def reconcile(self) -> ReconcileReport:
        """Makes files and rows agree, loads the LRU order, then trims to the budget.

        Removes temp files and block files without a row; drops rows whose file is missing or
        has the wrong length (deleting such a file); keeps only files that are block files.
        """
        rows = {r.block_hash: r for r in self._index.all_rows()}
        temps = orphans = 0
        on_disk: dict[BlockHash, int] = {}
        for path, block_hash, size in self.files.scan():
            if block_hash is None:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    temps += 1
                continue  # not ours: leave it alone
            if block_hash not in rows:
                path.unlink(missing_ok=True)
                orphans += 1
            else:
                on_disk[block_hash] = size
        bad = [h for h, r in rows.items() if on_disk.get(h) != r.size or r.fmt.nbytes != r.size]
        self._index.delete_many(bad)  # rows first, then their files (see the module docstring)
        for h in bad:
            if h in on_disk:
                self.files.remove(h)
        bad_set = set(bad)
        self._lru = OrderedDict((h, r) for h, r in rows.items() if h not in bad_set)  # LRU order
        self.used_bytes = sum(r.size for r in self._lru.values())
        evicted = self._evict_to_fit(0)
        return ReconcileReport(temps, orphans, len(bad), evicted)

    def put_many(self, items: Sequence[tuple[BlockHash, BlockFormat, torch.Tensor]]) -> PutResult:
        """Stores blocks (oldest first), evicting least recently used files to make room.

        Args:
            items: (hash, format, contiguous CPU uint8 row of ``format.nbytes``) each; a hash
                already stored in the same format is skipped, in another format it is replaced.
        """
        present = dropped = 0
        todo: list[tuple[BlockHash, BlockFormat, torch.Tensor]] = []
        for block_hash, fmt, row in items:
            old = self._lru.get(block_hash)
            if old is not None and old.fmt == fmt:
                present += 1
            else:
                todo.append((block_hash, fmt, row))
        # Keep the newest blocks that fit: the tail of the batch.
        kept: list[tuple[BlockHash, BlockFormat, torch.Tensor]] = []
        total = 0
        for item in reversed(todo):
            if total + item[1].nbytes <= self.capacity_bytes:
                kept.append(item)
                total += item[1].nbytes
            else:
                dropped += 1
        kept.reverse()
        if not kept:
            return PutResult(0, present, dropped)
        self._remove([h for h, _, _ in kept if h in self._lru])  # replaced formats
        self._evict_to_fit(total)
        crcs = self.files.write_many([(h, row.numpy().data) for h, _, row in kept])
        now = time.time()
        rows = [
            IndexRow(h, TIER_DISK, fmt.nbytes, crc, fmt, now, now)
            for (h, fmt, _), crc in zip(kept, crcs, strict=True)
        ]
        self._index.insert_many(rows)  # only now: every file is complete and renamed
        for r in rows:
            self._lru[r.block_hash] = r
            self.used_bytes += r.size
        if self._on_change is not None:
            self._on_change(True, [r.block_hash for r in rows])
        return PutResult(len(rows), present, dropped)

    def read_into(self, block_hash: BlockHash, out: torch.Tensor) -> IndexRow:
        """Fills the contiguous CPU uint8 tensor ``out`` with a verified copy of the block.

        Raises:
            KeyError: ``block_hash`` is not stored.
            BlockFault: the file is missing, truncated or fails its checksum (``out`` is garbage).
        """
        row = self._lru[block_hash]
        self.files.read_into(block_hash, out.numpy().data, row.checksum)
        return row

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Marks ``hashes`` most recently used, here and in the index."""
        hits = [h for h in hashes if h in self._lru]
        for h in hits:
            self._lru.move_to_end(h)
        self._index.touch_many(hits, time.time())

    def remove(self, block_hash: BlockHash) -> None:
        """Drops one block: its row, then its file."""
        self._remove([block_hash])

    def _remove(self, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        self._index.delete_many(hashes)
        held = []
        for h in hashes:
            row = self._lru.pop(h, None)
            if row is not None:
                self.used_bytes -= row.size
                held.append(h)
            self.files.remove(h)
        if self._on_change is not None and held:
            self._on_change(False, held)

    def _evict_to_fit(self, incoming: int) -> int:
        victims: list[BlockHash] = []
        freed = 0
        for h, row in self._lru.items():
            if self.used_bytes - freed + incoming <= self.capacity_bytes:
                break
            victims.append(h)
            freed += row.size
        self._remove(victims)
        return len(victims)
