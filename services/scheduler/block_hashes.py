"""A request's block hashes, computed once, and the offload-store hits they key.

The scheduler owns the hash seed (docs/design.md, "Prefix hashes"): :func:`extend_hashes` is the
one computation of a request's chained full-block hashes, incremental (a decode hashes at most the
block it completes). The kv-cache-manager's prefix map and the offload-store's keys both take them.
"""

from __future__ import annotations

import dataclasses

from services.kv_cache_manager.types import AllocationResult
from services.scheduler.offload import OffloadConnector
from services.scheduler.request import Request
from shared.hashing import BlockHash, hash_blocks


def extend_hashes(req: Request, seed: bytes, block_size: int) -> int:
    """Hashes the request's full blocks not hashed yet; returns how many full blocks it has."""
    n_full = req.num_tokens // block_size
    if len(req.block_hashes) < n_full:
        start = len(req.block_hashes)
        req.block_hashes.extend(hash_blocks(seed, req.all_token_ids(), block_size, req.spec.cache_salt,
                                            start_block=start, parent=req.block_hashes[-1] if start else None))
    return n_full


def full_block_hashes(req: Request, seed: bytes, block_size: int) -> list[BlockHash]:
    """The hashes of every full block of the request's tokens so far."""
    return req.block_hashes[: extend_hashes(req, seed, block_size)]


def load_external(offload: OffloadConnector, res: AllocationResult, hashes: list[BlockHash],
                  block_size: int) -> AllocationResult:
    """Fills the blocks the store holds (``hashes``: the request's); a failed tail is recomputed.

    NOTE: blocks that failed to load stay allocated; the runner recomputes their tokens into them
    in this same step, so the hashes the kv-cache-manager registered for them hold the right bytes
    by the step's end.
    """
    if not res.external_block_ids:
        return res
    first = res.num_cached_tokens // block_size
    ext = list(res.external_block_ids)
    loaded = offload.load(list(zip(hashes[first : first + len(ext)], ext, strict=True)))
    missing = (len(ext) - loaded) * block_size
    if missing == 0:
        return res
    return dataclasses.replace(res, num_computed_tokens=res.num_computed_tokens - missing,
                               num_new_tokens=res.num_new_tokens + missing)
