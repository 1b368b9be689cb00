"""Re-derives the pool's accounting from scratch and compares it with the incremental state.

Called by tests after every operation and by the CheckIntegrity RPC; it is O(blocks + table
entries), so it is not on any hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from services.kv_cache_manager.block_pool import BlockPool
from services.kv_cache_manager.request import RequestState
from shared.errors import IntegrityError
from shared.kv_layout import sink_blocks


def _check_tables(pool: BlockPool, req: RequestState, windows: Sequence[int | None], sinks: Sequence[int],
                  block_size: int, refs: Counter[int]) -> None:
    """One table per group, all of one length; the null block exactly at a window group's skipped
    head (after its sink blocks, with attention sinks)."""
    rid = req.request_id
    if len(req.tables) != len(windows) or req.tables[0] is not req.blocks:
        raise IntegrityError(f"request {rid!r}: {len(req.tables)} block tables for {len(windows)} groups")
    for g, table in enumerate(req.tables):
        skipped = req.num_skipped[g]
        first = sink_blocks(sinks[g], block_size) if sinks else 0
        if len(table) != len(req.blocks):
            raise IntegrityError(f"request {rid!r}: group {g} has {len(table)} blocks, group 0 {len(req.blocks)}")
        if skipped and windows[g] is None:
            raise IntegrityError(f"request {rid!r}: full group {g} skips {skipped} blocks")
        for i, block in enumerate(table):
            dead = first <= i < skipped
            if (block is pool.null_block) != dead:
                where = "holds the null block" if not dead else "holds a block it skipped"
                raise IntegrityError(f"request {rid!r}: group {g} position {i} {where}")
            if dead:
                continue
            if not 0 < block.block_id < len(pool.blocks) or pool.blocks[block.block_id] is not block:
                raise IntegrityError(f"request {rid!r} holds a block not in the pool: {block!r}")
            if block.block_hash is not None and block.group != g:
                raise IntegrityError(f"request {rid!r}: group {g} holds block {block.block_id} of group {block.group}")
            refs[block.block_id] += 1


def _check_requests(pool: BlockPool, requests: Iterable[RequestState], block_size: int,
                    windows: Sequence[int | None], sinks: Sequence[int]) -> Counter[int]:
    """Per-request invariants; returns how many live tables reference each block id."""
    refs: Counter[int] = Counter()
    for req in requests:
        rid = req.request_id
        _check_tables(pool, req, windows, sinks, block_size, refs)
        if not 0 <= req.num_computed_tokens <= req.num_tokens:
            raise IntegrityError(f"request {rid!r}: {req.num_computed_tokens} computed of {req.num_tokens}")
        least = -(-req.num_computed_tokens // block_size)
        most = max(least, -(-req.reserved_end // block_size))  # plus a lookahead reserve, if granted
        if not least <= len(req.blocks) <= most:
            raise IntegrityError(f"request {rid!r}: {len(req.blocks)} blocks for {req.num_computed_tokens} "
                                 f"computed tokens (expected {least}, or up to {most} with its lookahead)")
        if len(req.block_hashes) != req.num_tokens // block_size:
            raise IntegrityError(f"request {rid!r}: {len(req.block_hashes)} hashes for {req.num_tokens} tokens")
        if req.num_cached_blocks > min(len(req.block_hashes), req.num_computed_tokens // block_size):
            raise IntegrityError(f"request {rid!r}: {req.num_cached_blocks} cached blocks is too many")
    return refs


def check_integrity(pool: BlockPool, requests: Iterable[RequestState], block_size: int,
                    windows: Sequence[int | None] = (None,), sinks: Sequence[int] = ()) -> None:
    """Raises :class:`IntegrityError` describing the first inconsistency found.

    Checks: every non-null block is either referenced (``ref_cnt > 0``) or in the free queue,
    never both; the free queue's links and counter agree; ``ref_cnt`` equals the number of live
    block tables holding the block; the hash map and the blocks' hashes agree both ways; no
    table holds the null block but a window group's skipped head; each table covers exactly its
    computed tokens; each group's prefix map holds only that group's blocks.
    """
    null = pool.null_block
    if null.ref_cnt or null.block_hash is not None or null.prev_free is not None:
        raise IntegrityError("the null block is in use, cached or free")
    in_queue = {block.block_id for block in pool.free_queue.walk()}
    if 0 in in_queue:
        raise IntegrityError("the null block is in the free queue")
    refs = _check_requests(pool, requests, block_size, windows, sinks)
    for block in pool.blocks[1:]:
        bid = block.block_id
        if block.ref_cnt != refs[bid]:
            raise IntegrityError(f"block {bid}: ref_cnt {block.ref_cnt}, held by {refs[bid]} tables")
        if (block.ref_cnt > 0) == (bid in in_queue):
            state = "in use and free" if block.ref_cnt > 0 else "neither in use nor free"
            raise IntegrityError(f"block {bid} is {state}")
        if block.block_hash is not None:
            if not 0 <= block.group < len(pool.maps) or pool.maps[block.group].get(block.block_hash) is not block:
                raise IntegrityError(f"block {bid}'s hash does not map back to it in the prefix map")
            if block.token_ids is None or len(block.token_ids) != block_size:
                raise IntegrityError(f"cached block {bid} does not hold one full block of token ids")
        elif block.token_ids is not None:
            raise IntegrityError(f"block {bid} keeps token ids without a hash")
    for g, cached in enumerate(pool.maps):
        for block_hash, block in cached.items():
            if block.block_hash != block_hash or block.group != g:
                raise IntegrityError(f"group {g}'s prefix map entry {block_hash.hex()[:16]} points at block "
                                     f"{block.block_id}, which holds another hash or group")
