"""Plain data exchanged with the kv-cache-manager core (no grpc, no protobuf).

These mirror ``proto/kvmesh/v1/kv_cache_manager.proto``; the servicer converts between them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.event_hub import EventStreamEnded as _EventStreamEnded
from shared.hashing import BlockHash


@dataclass(frozen=True)
class AllocationSpec:
    """One request's part of a scheduler step (see ``Allocation`` in the proto).

    ``block_hashes``: the scheduler's hashes of the full blocks ``new_token_ids`` complete (on a
    new request, of every full block); the manager keys its prefix map on them and never hashes.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    num_new_tokens: int
    is_new: bool = False
    use_prefix_cache: bool = True
    is_resumed: bool = False
    num_external_blocks: int = 0
    block_hashes: tuple[BlockHash, ...] = ()
    num_lookahead_tokens: int = 0


class AllocationStatus(enum.Enum):
    """Outcome of one allocation."""

    OK = 1
    OUT_OF_BLOCKS = 2


@dataclass(frozen=True)
class AllocationResult:
    """Outcome of one allocation (see ``AllocationResult`` in the proto)."""

    request_id: str
    status: AllocationStatus
    new_block_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    num_new_tokens: int = 0
    num_cached_tokens: int = 0
    external_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block whose slot is reused by this step (its last chance to be saved)."""

    block_id: int
    block_hash: BlockHash


@dataclass(frozen=True)
class KVCacheStats:
    """Pool usage and prefix-cache counters (see ``KVCacheStats`` in the proto)."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage_percent: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    recompute_queries: int
    recompute_hits: int
    num_requests: int
    block_size: int
    num_evictions: int


@dataclass(frozen=True)
class StepResult:
    """Results of a whole step, aligned with the allocations sent."""

    results: tuple[AllocationResult, ...]
    evicted: tuple[EvictedBlock, ...]
    stats: KVCacheStats


@dataclass(frozen=True)
class BlockStored:
    """Event: full blocks registered in the prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Event: cached blocks evicted."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Event: the prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class PrefixLookup:
    """Read-only answer to a prefix query."""

    num_cached_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockTable:
    """One live request's blocks (see ``GetBlockTableResponse`` in the proto)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class KVEventBatch:
    """Events of one manager operation, in order; ``seq`` grows by one per published batch.

    NOTE: ``seq`` is global, not per subscriber, so a subscriber that was dropped for falling
    behind and resubscribes can tell how much it missed.
    """

    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class CachedBlocks:
    """The prefix cache's hashes as of event batch ``seq`` (see ``GetCachedBlocksResponse``).

    NOTE: the pair is what makes a resync exact: a subscriber registered before the snapshot
    skips batches up to ``seq`` (already in it) and applies every later one.
    """

    seq: int
    block_hashes: tuple[BlockHash, ...]


# Raised by every event client (kv-cache-manager and offload-store alike); one owner in shared/.
EventStreamEnded = _EventStreamEnded

