"""The block pool: every KV block's metadata, the free queue in eviction order, the prefix map.

Layout of the free queue (a doubly linked list threaded through the blocks themselves, so
taking a cached block out of it on a prefix hit is O(1))::

    head ⇄ [unhashed, freed last] ⇄ ... ⇄ [never used] ⇄ ... ⇄ [hashed, freed first] ⇄ tail
           ◀── popped first (allocation)                  appended last (least recently freed) ──▶

Allocation pops from the front. Freed blocks without a hash hold nothing reusable, so they go
to the front (reused first); hashed blocks go to the back, so cached prefixes are evicted in
LRU order. Block 0 is the null block: never in the queue, never handed out; a window group's
table holds it where a block slid out of the window.

One prefix map per KV cache group (``maps[g]``): the scheduler's hash names a token prefix, and
every group holds its own KV of that prefix, so the same hash in two groups is two blocks. Group
0's map is also ``cached``, the one the events, the snapshot and the offload path speak of.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.kv_cache_manager.types import EvictedBlock
from shared.errors import IntegrityError
from shared.hashing import BlockHash


class KVCacheBlock:
    """Metadata of one pool block; ``prev_free``/``next_free`` link it into the free queue.

    ``token_ids`` are the tokens the block holds while it is registered under ``block_hash``,
    kept so a prefix hit can be verified (a hash collision must be a miss, never wrong KV).
    """

    __slots__ = ("block_hash", "block_id", "group", "next_free", "prev_free", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.group = 0  # the KV cache group whose prefix map holds it (meaningful while hashed)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Blocks with ``ref_cnt == 0`` in eviction order; O(1) append, appendleft and remove.

    NOTE: two sentinel blocks (id -1) bound the list so that no operation needs a None check
    on its neighbours; a block is in the queue iff its ``prev_free`` is set.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the back: evicted last."""
        last = self._tail.prev_free
        if last is None or block.prev_free is not None:
            raise IntegrityError(f"block {block.block_id} is already in the free queue")
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the front: reused first."""
        first = self._head.next_free
        if first is None or block.prev_free is not None:
            raise IntegrityError(f"block {block.block_id} is already in the free queue")
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Takes ``block`` out of the queue wherever it is (a prefix hit on a free cached block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise IntegrityError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first ``n`` blocks (the caller checked that there are enough)."""
        if n > self.num_free_blocks:
            raise IntegrityError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        cur = self._head.next_free
        for _ in range(n):
            if cur is None or cur is self._tail:
                raise IntegrityError("free queue shorter than its counter")
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        if cur is None:
            raise IntegrityError("free queue broken after pop")
        self._head.next_free = cur
        cur.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back; bounded so a corrupted (cyclic) list cannot loop forever."""
        cur = self._head.next_free
        for _ in range(self.num_free_blocks + 1):
            if cur is None or cur is self._tail:
                return
            yield cur
            cur = cur.next_free

    def walk(self) -> list[KVCacheBlock]:
        """Front to back, following both link directions; raises on any inconsistency."""
        out: list[KVCacheBlock] = []
        prev = self._head
        cur = self._head.next_free
        limit = self.num_free_blocks
        while cur is not self._tail:
            if cur is None or cur.prev_free is not prev:
                raise IntegrityError(f"free queue links broken after {len(out)} blocks")
            if len(out) > limit:
                raise IntegrityError(f"free queue longer than its counter {limit} (cycle?)")
            out.append(cur)
            prev, cur = cur, cur.next_free
        if self._tail.prev_free is not prev:
            raise IntegrityError("free queue tail link broken")
        if len(out) != limit:
            raise IntegrityError(f"free queue holds {len(out)} blocks, counter says {limit}")
        return out


class BlockPool:
    """Every block, the free queue and, per group, the ``block hash -> block`` map of cached full blocks.

    Args:
        num_blocks: pool size including the null block 0 (so ``num_blocks - 1`` are usable).
        num_groups: KV cache groups sharing the pool (one prefix map each).
    """

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.maps: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.cached = self.maps[0]
        self.num_evictions = 0

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks over every group."""
        return sum(len(m) for m in self.maps)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached or not)."""
        return self.free_queue.num_free_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks; a free one leaves the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int, evicted: list[EvictedBlock]) -> list[KVCacheBlock]:
        """Pops ``n`` blocks from the front; a cached one is evicted.

        ``evicted`` gets group 0's evictions only: they are what the events and the offload path
        speak of (a hash alone does not say which group's KV a block held); ``num_evictions``
        counts every group's.
        """
        blocks = self.free_queue.popleft_n(n)
        maps = self.maps
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                del maps[block.group][block_hash]
                block.block_hash = None
                block.token_ids = None
                if block.group == 0:
                    evicted.append(EvictedBlock(block.block_id, block_hash))
                self.num_evictions += 1
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block, in the given order (callers pass tails first)."""
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                    group: int = 0) -> bool:
        """Registers a computed full block under its hash in ``group``'s map.

        Returns:
            False when the hash is already served by another block of that group (a duplicate
            computed concurrently): the existing mapping is kept and ``block`` stays unregistered.
        """
        cached = self.maps[group]
        if block_hash in cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.group = group
        cached[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> BlockHash | None:
        """Unregisters ``block`` if it serves a hash (its KV was never written); returns that hash."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        del self.maps[block.group][block_hash]
        block.block_hash = None
        block.token_ids = None
        return block_hash

    def reset_prefix_cache(self) -> int:
        """Forgets every cached hash (the caller checked that no block is in use)."""
        num = 0
        for cached in self.maps:
            for block in cached.values():
                block.block_hash = None
                block.token_ids = None
            num += len(cached)
            cached.clear()
        return num
