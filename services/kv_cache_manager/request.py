"""Per-request state the manager keeps between steps: tokens, block table, hashes, progress.

A request's block table covers its computed tokens plus those scheduled this step::

    tokens:  |<------------- num_tokens (known) ------------->|
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ]
             |<-- cached -->|        full, hashed, registered: num_cached_blocks = 2
             |<---- num_computed_tokens ---->|

Hashes are kept for every *known* full block and extended incrementally as tokens arrive, so a
decode step hashes at most the one block it completes, never the whole prompt again.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_cache_manager.block_pool import KVCacheBlock
from shared.hashing import BlockHash, hash_blocks


class RequestState:
    """One live request.

    Args:
        request_id: unique among live requests.
        token_ids: every token known so far (the prompt, or prompt + output on a resume).
        block_hashes: hashes of the full blocks of ``token_ids`` (computed by the caller,
            which needs them for the prefix lookup before the request exists).
        cache_salt: mixed into the first block's hash; kept for hashing later blocks' parents.
    """

    __slots__ = ("block_hashes", "blocks", "cache_salt", "num_cached_blocks", "num_committed_blocks",
                 "num_computed_tokens",
                 "request_id", "token_ids")

    def __init__(self, request_id: str, token_ids: list[int], block_hashes: list[BlockHash],
                 cache_salt: bytes) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.block_hashes = block_hashes
        self.cache_salt = cache_salt
        self.blocks: list[KVCacheBlock] = []
        self.num_computed_tokens = 0
        # Leading blocks already registered in the prefix map (or skipped as duplicates).
        self.num_cached_blocks = 0
        # Leading registered blocks whose KV is known to be written: those registered before the
        # latest allocation (plus prefix hits). A rollback unregisters the ones past it.
        self.num_committed_blocks = 0

    @property
    def num_tokens(self) -> int:
        """Tokens known to the manager."""
        return len(self.token_ids)

    def append_tokens(self, new_token_ids: Sequence[int], seed: bytes, block_size: int) -> None:
        """Appends tokens and hashes only the full blocks they complete."""
        tokens = self.token_ids
        tokens.extend(new_token_ids)
        hashes = self.block_hashes
        start = len(hashes)
        if len(tokens) // block_size > start:
            parent = hashes[-1] if start else None
            hashes.extend(hash_blocks(seed, tokens, block_size, self.cache_salt,
                                      start_block=start, parent=parent))
