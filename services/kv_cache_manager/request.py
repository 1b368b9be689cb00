"""Per-request state the manager keeps between steps: counts, hashes, block table, the unregistered tail.

A request's block table covers its computed tokens plus those scheduled this step::

    tokens:  |<------------- num_tokens (known) ------------->|
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ]
             |<-- cached -->|        full, hashed, registered: num_cached_blocks = 2
             |<---- num_computed_tokens ---->|
                            |<------ tail_token_ids --------->|

With several KV cache groups the request has one table per group (``tables``), all of one
length: position ``i`` of every table holds the group's KV of tokens ``i*bs .. (i+1)*bs - 1``. A
window group's leading ``num_skipped[g]`` positions hold the null block: those blocks slid out of
every future query's window and went back to the pool (or were never needed, on a prefix hit)::

    full group:    [ b1 ][ b2 ][ b3 ][ b4 ][ b5 ]
    window group:  [ 0  ][ 0  ][ b8 ][ b9 ][ b10]     num_skipped = 2
    with a sink:   [ b6 ][ 0  ][ b8 ][ b9 ][ b10]     num_skipped = 2, sink blocks = 1

With attention sinks (StreamingLLM) the group's first ``ceil(sinks / block_size)`` blocks are never
freed: the null positions are ``sink blocks .. num_skipped - 1`` (shared/kv_layout.py's ``dead_range``).

The hashes come from the scheduler (the seed's one owner, shared/hashing.py), with the tokens
that complete their blocks; the manager never hashes. It keeps token ids only for blocks not yet
registered (the tail): a registered block holds its own tokens (the hit check compares them), so
the request keeps no second copy of them and a long decode holds less than one block of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_cache_manager.block_pool import KVCacheBlock
from shared.hashing import BlockHash
from shared.kv_layout import dead_range


class RequestState:
    """One live request.

    Args:
        request_id: unique among live requests.
        num_tokens: tokens known so far (the prompt, or prompt + output on a resume).
        tail_token_ids: the known tokens from block ``num_cached_blocks`` on.
        block_hashes: hashes of the known full blocks, as the scheduler sent them.
        num_cached_blocks: leading blocks already registered (prefix hits).
    """

    __slots__ = ("block_hashes", "blocks", "num_cached_blocks", "num_committed_blocks",
                 "num_computed_tokens", "num_skipped", "num_tokens", "request_id", "reserved_end", "tables",
                 "tail_token_ids")

    def __init__(self, request_id: str, num_tokens: int, tail_token_ids: list[int],
                 block_hashes: list[BlockHash], num_cached_blocks: int = 0,
                 tables: list[list[KVCacheBlock]] | None = None) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.tail_token_ids = tail_token_ids
        self.block_hashes = block_hashes
        # One block table per KV cache group; ``blocks`` is group 0's (the only one of most models).
        self.tables: list[list[KVCacheBlock]] = tables if tables is not None else [[]]
        self.blocks: list[KVCacheBlock] = self.tables[0]
        # Per group, the end of its positions that hold the null block (always 0 for a full group);
        # they start at 0, or after the sink blocks with attention sinks.
        self.num_skipped = [0] * len(self.tables)
        self.num_computed_tokens = 0
        # The furthest slot end any allocation asked for, lookahead included (async scheduling's
        # reserve): the table holds blocks for at least the computed tokens and at most up to here.
        self.reserved_end = 0
        # Leading blocks already registered in the prefix map (or skipped as duplicates).
        self.num_cached_blocks = num_cached_blocks
        # Leading registered blocks whose KV is known to be written: those registered before the
        # latest allocation (plus prefix hits). A rollback unregisters the ones past it.
        self.num_committed_blocks = num_cached_blocks

    def append(self, new_token_ids: Sequence[int], new_hashes: Sequence[BlockHash]) -> None:
        """Appends tokens and the hashes of the blocks they complete."""
        self.tail_token_ids.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        self.block_hashes.extend(new_hashes)

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        """The tokens of full block ``index`` (not yet registered, so still in the tail)."""
        start = (index - self.num_cached_blocks) * block_size
        return tuple(self.tail_token_ids[start : start + block_size])

    def mark_cached(self, end: int, block_size: int) -> None:
        """Blocks up to ``end`` are registered: their tokens now live in the blocks, not here."""
        del self.tail_token_ids[: (end - self.num_cached_blocks) * block_size]
        self.num_cached_blocks = end

    def dead_blocks(self, window_groups: Sequence[tuple[int, int]], block_size: int,
                    position: int, sinks: Sequence[int] = ()) -> list[KVCacheBlock]:
        """The window groups' blocks still held that are dead for a step starting at ``position``.

        Latest position first, so the earliest is freed last and so evicted last (as a tail-first
        free). ``window_groups``: (group, window) of each window group; ``sinks``: per group its
        attention-sink tokens (empty = none), whose blocks never die (``dead_range``).
        """
        out: list[KVCacheBlock] = []
        for g, window in window_groups:
            table = self.tables[g]
            end = dead_range(window, sinks[g] if sinks else 0, block_size, position)[1]
            out += [table[i] for i in range(end - 1, self.num_skipped[g] - 1, -1)]
        return out

    def skip_dead(self, window_groups: Sequence[tuple[int, int]], block_size: int, position: int,
                  null: KVCacheBlock, sinks: Sequence[int] = ()) -> None:
        """Puts ``null`` where :meth:`dead_blocks` found blocks (the caller frees those)."""
        for g, window in window_groups:
            table = self.tables[g]
            end = dead_range(window, sinks[g] if sinks else 0, block_size, position)[1]
            for i in range(self.num_skipped[g], end):
                table[i] = null
            self.num_skipped[g] = max(end, self.num_skipped[g])
