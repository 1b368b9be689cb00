"""OffloadStore: saves pool blocks into the tiers and loads them back, keyed by block hash.

::

    pool (shared memory) ──save──▶ DRAM tier ──evict (demote)──▶ disk tier ──▶ index (SQL)
            ▲   │                      │                           │
            │   └──save (if enabled)──▶ remote tier (Redis, shared by every replica)
            └──────────load────────────┴──(verify, promote)────────┘

Tiers are inclusive: a disk hit is promoted to DRAM and stays on disk, so demoting it again
costs nothing. The remote tier (off unless configured) is asked after DRAM and disk, and a remote
hit is promoted to DRAM like a disk hit. Data faults (a missing, truncated or corrupt file or
remote value) never raise: they are counted, the bad entry is removed and the load stops there;
bytes are verified *before* they reach the pool, so a failed block leaves the pool block
untouched. Malformed requests raise :mod:`shared.errors` exceptions before anything changes.

Every verb's tier changes leave as one numbered event batch (services/offload_store/events.py,
``hub``), and :meth:`OffloadStore.stored_blocks` is the matching snapshot, so a router can keep a
per-tier index of this store exactly as it keeps one of the pool.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from services.offload_store.block_copy import copy_in, copy_out
from services.offload_store.block_files import BlockFault
from services.offload_store.config import OffloadConfig
from services.offload_store.disk_tier import DiskTier, ReconcileReport
from services.offload_store.dram_tier import DramTier
from services.offload_store.events import OffloadEventHub, TierJournal
from services.offload_store.index import BlockIndex
from services.offload_store.pool_mapping import MappedPool, PoolHandle, map_pool
from services.offload_store.remote_tier import RemoteTier, copy_payload, open_remote
from services.offload_store.types import BlockFormat, LoadResult, LookupResult, OffloadStats, SaveResult, StoredBlocks
from shared.errors import FailedPrecondition, IntegrityError, InvalidArgument
from shared.hashing import HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _publishing(verb: F) -> F:
    """Publishes the tier changes of one call of ``verb`` as one event batch, however it ends."""
    @functools.wraps(verb)
    def wrapped(self: OffloadStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return verb(self, *args, **kwargs)
        finally:
            self._journal.flush()
    return cast(F, wrapped)


# Bounce rows for blocks that do not go through a DRAM slot: write-through saves (DRAM disabled)
# and disk loads that cannot be promoted. Also the batch size of those paths.
_STAGING_ROWS = 16


class OffloadStore:
    """The offload-store without gRPC. Not thread-safe: the servicer serialises calls.

    Args:
        config: data dir, index URL and tier budgets.
    """

    def __init__(self, config: OffloadConfig, hub: OffloadEventHub | None = None) -> None:
        self.config = config
        self.hub = hub if hub is not None else OffloadEventHub()
        self._journal = TierJournal(self.hub, config.remote_index_blocks)
        os.makedirs(config.data_dir, exist_ok=True)
        self._index = BlockIndex(config.resolved_db_url, config.db_table)
        self._disk = DiskTier(config.data_dir, self._index, config.disk_bytes, self._journal.listener("disk"))
        self.reconcile_report: ReconcileReport = self._disk.reconcile()
        self._dram = DramTier(config.dram_bytes, demote=self._demote, on_change=self._journal.listener("dram"))
        self._journal.flush()
        self.remote: RemoteTier | None = open_remote(config)  # public for its counters (metrics)
        self._pool: MappedPool | None = None
        self._pool_generation = ""
        self._staging = torch.empty((0, 0), dtype=torch.uint8)
        self._stats = OffloadStats()

    def close(self) -> None:
        """Releases the pool mapping and the index connections (DRAM contents are dropped)."""
        self._pool = None
        if self.remote is not None:
            self.remote.close()
        self._disk.close()
        self._index.close()

    # --- the five verbs --------------------------------------------------------------------------

    @_publishing
    def attach_pool(self, handle: PoolHandle) -> int:
        """Maps the runner's pool (replacing any earlier mapping); returns bytes per block."""
        pool = map_pool(handle, self.config.pool_dir)
        self._pool = pool
        self._pool_generation = handle.generation
        self._dram.configure(pool.block_format.nbytes, pin=pool.is_cuda)
        log.info("attached pool %s (%s, generation %r), %d bytes per block",
                 handle.path or "cuda_ipc", handle.dtype, handle.generation, pool.block_format.nbytes)
        return pool.block_format.nbytes

    @_publishing
    def lookup(self, hashes: Sequence[bytes]) -> LookupResult:
        """The longest leading run of ``hashes`` held in any tier, and how many are in DRAM.

        Before a pool is attached any format counts; afterwards only blocks the pool can receive.
        """
        _check_hashes(hashes)
        fmt = self._pool.block_format if self._pool is not None else None
        present = in_dram = start = 0
        remote: list[bool] = []  # remote presence of hashes[start:], asked at the first local miss
        for i, raw in enumerate(hashes):
            h = BlockHash(raw)
            dram = self._dram.peek(h)
            dram_ok = dram is not None and (fmt is None or dram.fmt == fmt)
            disk = self._disk.get(h)
            if not dram_ok and (disk is None or (fmt is not None and disk.fmt != fmt)):
                if not remote and self.remote is not None:
                    start, remote = i, self.remote.present([BlockHash(r) for r in hashes[i:]], fmt)
                if not remote or not remote[i - start]:
                    self._journal.remote_gone([h])
                    break
                self._journal.remote_seen([h])
            present += 1
            in_dram += int(dram_ok)
        return LookupResult(present, in_dram)

    @_publishing
    def save(self, blocks: Sequence[tuple[bytes, int]]) -> SaveResult:
        """Copies pool blocks into the DRAM tier (or straight to disk when DRAM holds no block).

        A hash already held in the pool's format is skipped (same hash, same bytes).
        """
        pool = self._require_pool()
        _check_hashes([h for h, _ in blocks])
        _check_block_ids(pool, [b for _, b in blocks])
        fmt = pool.block_format
        todo: list[tuple[BlockHash, int]] = []
        seen: set[BlockHash] = set()
        for raw, block_id in blocks:
            h = BlockHash(raw)
            if h in seen or self._holds(h, fmt):
                continue
            seen.add(h)
            todo.append((h, block_id))
        saved = self._save_dram(pool, todo) if self._dram.num_slots else self._save_disk(pool, todo)
        self._stats.saves += saved
        return SaveResult(saved, len(blocks) - len(todo))

    @_publishing
    def load(self, blocks: Sequence[tuple[bytes, int]]) -> LoadResult:
        """Copies stored blocks into pool blocks, in order, stopping at the first failure.

        DRAM hits and verified disk reads are queued and copied into the pool in bursts (one
        ``copy_`` per block, back to back), not interleaved with file I/O: measured here with two
        torch threads, a copy right after a blocking read paid the wake-up of the idle OpenMP
        worker, 5-20 ms on a busy machine, versus 0.05 ms back to back.

        Returns:
            How many leading blocks were loaded, and the hash that failed (if one did).
        """
        pool = self._require_pool()
        _check_hashes([h for h, _ in blocks])
        ids = [b for _, b in blocks]
        _check_block_ids(pool, ids)
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a load names the same pool block twice")
        fmt = pool.block_format
        # NOTE: a promotion must not evict a block of this same load: a later one would turn from a
        # DRAM hit into a disk read, and an earlier one may still sit in `pending`, not yet copied.
        protect = frozenset(BlockHash(raw) for raw, _ in blocks)
        staging = self._staging_rows(pool, _STAGING_ROWS)
        pending: list[tuple[int, torch.Tensor]] = []  # (pool block id, verified bytes) to copy in
        staged = 0  # staging rows in use by `pending`
        loaded = 0
        from_disk: list[BlockHash] = []
        failed: list[BlockHash] = []
        fetched: dict[BlockHash, memoryview | None] = {}  # verified remote payloads, one batch
        for k, (raw, block_id) in enumerate(blocks):
            h = BlockHash(raw)
            entry = self._dram.get(h)
            if entry is not None and entry.fmt == fmt:
                pending.append((block_id, self._dram.row(entry)))
                self._stats.dram_hits += 1
                loaded += 1
                continue
            stored = self._disk.get(h)
            on_disk = stored is not None and stored.fmt == fmt
            if not on_disk and h not in fetched and self.remote is not None:  # the next remote batch
                rest = [BlockHash(r) for r, _ in blocks[k:]]
                fetched = self.remote.get_batch(rest, fmt, held=lambda x: self._holds(x, fmt))
            payload = None if on_disk else fetched.get(h)
            if payload is not None:
                self._journal.remote_seen([h])
            if not on_disk and payload is None:
                if h in fetched:  # asked and not served: gone from Redis (or Redis unreachable)
                    self._journal.remote_gone([h])
                self._stats.misses += 1
                failed.append(h)
                break
            slots = self._dram.reserve([(h, fmt)], protect=protect) if self._dram.num_slots else None
            if slots is None and staged == len(staging):
                self._copy_in(pool, pending)
                staged = 0
            buf = slots[0] if slots is not None else staging[staged]
            if payload is not None:
                copy_payload(payload, buf)
            elif self._read_verified(h, buf, promoted=slots is not None):
                from_disk.append(h)
            else:
                failed.append(h)
                break
            staged += slots is None
            pending.append((block_id, buf))
            loaded += 1
        self._copy_in(pool, pending)
        self._disk.touch(from_disk)
        return LoadResult(loaded, failed)

    def stats(self) -> OffloadStats:
        """Current usage and counters (a copy)."""
        s = self._stats
        return OffloadStats(
            dram_blocks=len(self._dram), dram_bytes=self._dram.used_bytes,
            dram_capacity_bytes=self.config.dram_bytes, disk_blocks=len(self._disk),
            disk_bytes=self._disk.used_bytes, disk_capacity_bytes=self.config.disk_bytes,
            dram_hits=s.dram_hits, disk_hits=s.disk_hits, misses=s.misses, saves=s.saves,
            corruptions=s.corruptions, dropped=s.dropped, pool_attached=self._pool is not None,
            pool_generation=self._pool_generation if self._pool is not None else "",
            refused_no_pool=s.refused_no_pool,
        )

    def stored_blocks(self) -> StoredBlocks:
        """Every tier's hashes with the number of the last event batch they include."""
        return self._journal.snapshot(list(self._dram), self._disk.hashes())

    def detach_pool(self) -> None:
        """Unmaps the pool (its owner left); stored blocks stay, saves and loads are refused."""
        self._pool = None
        self._pool_generation = ""

    # --- internals -------------------------------------------------------------------------------

    def _require_pool(self) -> MappedPool:
        if self._pool is None:
            self._stats.refused_no_pool += 1
            raise FailedPrecondition("no KV pool attached: call AttachPool first")
        return self._pool

    def _holds(self, h: BlockHash, fmt: BlockFormat) -> bool:
        dram = self._dram.peek(h)
        disk = self._disk.get(h)
        return (dram is not None and dram.fmt == fmt) or (disk is not None and disk.fmt == fmt)

    def _save_dram(self, pool: MappedPool, todo: list[tuple[BlockHash, int]]) -> int:
        fmt = pool.block_format
        step = self._dram.num_slots  # a batch larger than DRAM pushes its own head to disk
        for i in range(0, len(todo), step):
            chunk = todo[i : i + step]
            rows = self._dram.reserve([(h, fmt) for h, _ in chunk])
            if rows is None:  # chunks never exceed the slots and nothing is protected
                raise IntegrityError("DRAM tier refused a save chunk that fits")
            copy_out(pool, [b for _, b in chunk], rows)
            self._put_remote(chunk, fmt, rows)
        return len(todo)

    def _save_disk(self, pool: MappedPool, todo: list[tuple[BlockHash, int]]) -> int:
        fmt = pool.block_format
        staging = self._staging_rows(pool, _STAGING_ROWS)
        written = 0
        for i in range(0, len(todo), _STAGING_ROWS):
            chunk = todo[i : i + _STAGING_ROWS]
            rows = list(staging[: len(chunk)])
            copy_out(pool, [b for _, b in chunk], rows)
            self._put_remote(chunk, fmt, rows)
            result = self._disk.put_many([(h, fmt, r) for (h, _), r in zip(chunk, rows, strict=True)])
            self._stats.dropped += result.dropped
            written += result.written
        return written

    def _put_remote(self, chunk: list[tuple[BlockHash, int]], fmt: BlockFormat, rows: list[torch.Tensor]) -> None:
        if self.remote is not None:
            stored: list[BlockHash] = []
            self.remote.put_many([(h, fmt, r) for (h, _), r in zip(chunk, rows, strict=True)], stored=stored)
            self._journal.remote_seen(stored)

    def _read_verified(self, h: BlockHash, buf: torch.Tensor, promoted: bool) -> bool:
        """Reads the disk block ``h`` into ``buf`` and verifies it. On a fault: counts it, drops
        the entry (row and file) and frees the DRAM slot reserved for it (if ``promoted``)."""
        try:
            self._disk.read_into(h, buf)
        except BlockFault as fault:
            log.warning("offload block fault: %s", fault)
            if promoted:
                self._dram.discard(h)
            self._disk.remove(h)
            if fault.reason == "missing":
                self._stats.misses += 1
            else:
                self._stats.corruptions += 1
            return False
        self._stats.disk_hits += 1
        return True

    def _copy_in(self, pool: MappedPool, pending: list[tuple[int, torch.Tensor]]) -> None:
        if pending:
            copy_in(pool, [b for b, _ in pending], [r for _, r in pending])
            pending.clear()

    def _demote(self, items: list[tuple[BlockHash, BlockFormat, torch.Tensor]]) -> None:
        result = self._disk.put_many(items)
        self._stats.dropped += result.dropped

    def _staging_rows(self, pool: MappedPool, n: int) -> torch.Tensor:
        nbytes = pool.block_format.nbytes
        stale = self._staging.is_pinned() != pool.is_cuda
        if stale or self._staging.shape[0] < n or self._staging.shape[1] != nbytes:
            staging = torch.empty((max(n, _STAGING_ROWS), nbytes), dtype=torch.uint8)
            self._staging = staging.pin_memory() if pool.is_cuda else staging
        return self._staging[:n]


def _check_hashes(hashes: Sequence[bytes]) -> None:
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise InvalidArgument(f"a block hash must be {HASH_BYTES} bytes, got {len(h)}")


def _check_block_ids(pool: MappedPool, ids: Sequence[int]) -> None:
    for b in ids:
        if not 0 < b < pool.num_blocks:  # block 0 is the null block: it never holds tokens
            raise InvalidArgument(f"block id {b} is outside 1..{pool.num_blocks - 1}")
