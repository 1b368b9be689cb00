"""The longest prefix hit over every KV cache group (vLLM's hybrid rule, with the window groups' rule).

A hit of ``k`` blocks means the request's computation starts at position ``p = k * block_size``,
so it must find cached KV for every key a query at ``p`` or later can see:

* a **full** group needs blocks ``0 .. k-1`` (the leading run of its prefix map);
* a **window** group of window ``w`` needs only the blocks covering tokens ``p - w + 1 .. p - 1``:
  blocks ``dead_blocks(w, p) .. k-1``; the positions before them are the null block in the table
  the request gets (shared/kv_layout.py's ``dead_blocks``);
* a window group with **attention sinks** (StreamingLLM) needs those and its sink blocks
  ``0 .. ceil(sinks / block_size) - 1`` too; the null positions are the dead middle between
  (shared/kv_layout.py's ``dead_range``).

The full groups' condition holds for every ``k`` below their run, the window groups' does not (a
window's blocks may be cached at ``k`` and partly evicted at ``k - 1``), so the search takes the
shortest full run and then lowers ``k`` through the window groups until every group agrees::

    full:    [h][h][h][h][h][h][ ]      run = 6
    w = 32:  [ ][ ][ ][h][ ][h][h]      k = 6 needs blocks 4, 5 (bs 16): 4 is missing -> k = 6 fails,
                                        k = 4 needs 2, 3: 2 is missing -> ... -> k = 0

A block's stored token ids are compared with the request's (a colliding hash is a miss). NOTE: a
window group compares only its window's blocks; the tokens before them are covered by the chained
hash (and, in a model with a full group, by that group's check of every block).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_cache_manager.block_pool import BlockPool, KVCacheBlock
from shared.hashing import BlockHash
from shared.kv_layout import dead_range


def _matches(block: KVCacheBlock | None, tokens: Sequence[int] | None, i: int, bs: int) -> bool:
    return block is not None and (tokens is None or block.token_ids == tuple(tokens[i * bs : (i + 1) * bs]))


def _leading_run(cached: dict[BlockHash, KVCacheBlock], hashes: Sequence[BlockHash],
                 tokens: Sequence[int] | None, limit: int, bs: int) -> int:
    for i in range(limit):
        if not _matches(cached.get(hashes[i]), tokens, i, bs):
            return i
    return limit


def _window_hit(cached: dict[BlockHash, KVCacheBlock], window: int, sinks: int, hashes: Sequence[BlockHash],
                tokens: Sequence[int] | None, limit: int, bs: int) -> int:
    """The largest ``k <= limit`` whose live blocks (all but ``dead_range(k * bs)``) are all cached.

    Scans right to left (as vLLM's ``SlidingWindowManager``): only the top of a contiguous run of
    cached blocks can be a hit (the needed range grows with ``k``), and it is one once the run
    reaches down to that top's first live block; a missing block starts a new run below it. With
    sinks the scan then jumps over the dead middle to the sink blocks, every one of which is
    needed: a missing sink block ``i`` caps the hit at ``i`` (a hit that short is all sinks).
    """
    top = limit
    i = limit - 1
    while i >= 0:
        first, end = dead_range(window, sinks, bs, top * bs)
        if first <= i < end:
            if not first:
                return top  # blocks i+1 .. top-1 are cached and cover top's window
            i = first - 1  # the window is cached: on to the sink blocks
            continue
        if not _matches(cached.get(hashes[i]), tokens, i, bs):
            top = i
        i -= 1
    return top  # every live block of 0 .. top-1 is cached


def find_longest_hit(pool: BlockPool, windows: Sequence[int | None], hashes: Sequence[BlockHash],
                     tokens: Sequence[int] | None, max_blocks: int,
                     bs: int, sinks: Sequence[int] = ()) -> tuple[int, list[list[KVCacheBlock]]]:
    """The longest hit and, per group, its table (``k`` entries; the null block before a window).

    Args:
        windows: per group its window, None = full.
        sinks: per group its attention-sink tokens; empty = none.
        tokens: the sequence, to verify each hit block's stored tokens (None: by hash alone).
        max_blocks: cap on the hit (callers pass ``(num_tokens - 1) // block_size``).
    """
    maps = pool.maps
    k = min(max_blocks, len(hashes))
    for g, window in enumerate(windows):
        if window is None and k:
            k = _leading_run(maps[g], hashes, tokens, k, bs)
    changed = True
    while changed and k:
        changed = False
        for g, window in enumerate(windows):
            if window is not None:
                found = _window_hit(maps[g], window, sinks[g] if sinks else 0, hashes, tokens, k, bs)
                if found < k:
                    k, changed = found, True
    null = pool.null_block
    tables: list[list[KVCacheBlock]] = []
    for g, window in enumerate(windows):
        first, end = dead_range(window, sinks[g] if sinks else 0, bs, k * bs)
        cached = maps[g]
        tables.append([null if first <= i < end else cached[hashes[i]] for i in range(k)])
    return k, tables
