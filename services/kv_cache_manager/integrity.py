"""Re-derives the pool's accounting from scratch and compares it with the incremental state.

Called by tests after every operation and by the CheckIntegrity RPC; it is O(blocks + table
entries), so it is not on any hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from services.kv_cache_manager.block_pool import BlockPool
from services.kv_cache_manager.request import RequestState
from shared.errors import IntegrityError


def _check_requests(pool: BlockPool, requests: Iterable[RequestState], block_size: int) -> Counter[int]:
    """Per-request invariants; returns how many live tables reference each block id."""
    refs: Counter[int] = Counter()
    for req in requests:
        rid = req.request_id
        for block in req.blocks:
            if block.block_id == 0:
                raise IntegrityError(f"request {rid!r} holds the null block")
            if not 0 < block.block_id < len(pool.blocks) or pool.blocks[block.block_id] is not block:
                raise IntegrityError(f"request {rid!r} holds a block not in the pool: {block!r}")
            refs[block.block_id] += 1
        if not 0 <= req.num_computed_tokens <= req.num_tokens:
            raise IntegrityError(f"request {rid!r}: {req.num_computed_tokens} computed of {req.num_tokens}")
        expected_blocks = -(-req.num_computed_tokens // block_size)
        if len(req.blocks) != expected_blocks:
            raise IntegrityError(f"request {rid!r}: {len(req.blocks)} blocks for "
                                 f"{req.num_computed_tokens} computed tokens (expected {expected_blocks})")
        if len(req.block_hashes) != req.num_tokens // block_size:
            raise IntegrityError(f"request {rid!r}: {len(req.block_hashes)} hashes for {req.num_tokens} tokens")
        if req.num_cached_blocks > min(len(req.block_hashes), req.num_computed_tokens // block_size):
            raise IntegrityError(f"request {rid!r}: {req.num_cached_blocks} cached blocks is too many")
    return refs


def check_integrity(pool: BlockPool, requests: Iterable[RequestState], block_size: int) -> None:
    """Raises :class:`IntegrityError` describing the first inconsistency found.

    Checks: every non-null block is either referenced (``ref_cnt > 0``) or in the free queue,
    never both; the free queue's links and counter agree; ``ref_cnt`` equals the number of live
    block tables holding the block; the hash map and the blocks' hashes agree both ways; no
    table holds the null block; each table covers exactly its computed tokens.
    """
    null = pool.null_block
    if null.ref_cnt or null.block_hash is not None or null.prev_free is not None:
        raise IntegrityError("the null block is in use, cached or free")
    in_queue = {block.block_id for block in pool.free_queue.walk()}
    if 0 in in_queue:
        raise IntegrityError("the null block is in the free queue")
    refs = _check_requests(pool, requests, block_size)
    for block in pool.blocks[1:]:
        bid = block.block_id
        if block.ref_cnt != refs[bid]:
            raise IntegrityError(f"block {bid}: ref_cnt {block.ref_cnt}, held by {refs[bid]} tables")
        if (block.ref_cnt > 0) == (bid in in_queue):
            state = "in use and free" if block.ref_cnt > 0 else "neither in use nor free"
            raise IntegrityError(f"block {bid} is {state}")
        if block.block_hash is not None:
            if pool.cached.get(block.block_hash) is not block:
                raise IntegrityError(f"block {bid}'s hash does not map back to it in the prefix map")
            if block.token_ids is None or len(block.token_ids) != block_size:
                raise IntegrityError(f"cached block {bid} does not hold one full block of token ids")
        elif block.token_ids is not None:
            raise IntegrityError(f"block {bid} keeps token ids without a hash")
    for block_hash, block in pool.cached.items():
        if block.block_hash != block_hash:
            raise IntegrityError(f"prefix map entry {block_hash.hex()[:16]} points at block "
                                 f"{block.block_id}, which holds another hash")
