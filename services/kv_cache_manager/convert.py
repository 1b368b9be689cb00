"""Conversions between the generated protobuf messages and the core's dataclasses (types.py)."""

from __future__ import annotations

from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationSpec,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
    BlockTable,
    CachedBlocks,
    KVCacheStats,
    KVEvent,
    KVEventBatch,
    PrefixLookup,
    StepResult,
)
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb

_STATUS = {
    AllocationStatus.OK: pb.AllocationResult.STATUS_OK,
    AllocationStatus.OUT_OF_BLOCKS: pb.AllocationResult.STATUS_OUT_OF_BLOCKS,
}


def spec_from_pb(msg: pb.Allocation) -> AllocationSpec:
    """One request's part of a step."""
    return AllocationSpec(
        request_id=msg.request_id,
        # NOTE: slicing the repeated field first is ~40% faster than tuple() on it directly.
        new_token_ids=tuple(msg.new_token_ids[:]),
        num_new_tokens=msg.num_new_tokens,
        is_new=msg.is_new,
        cache_salt=msg.cache_salt,
        use_prefix_cache=msg.use_prefix_cache,
        is_resumed=msg.is_resumed,
        num_external_blocks=msg.num_external_blocks,
    )


def stats_to_pb(stats: KVCacheStats) -> pb.KVCacheStats:
    """Pool statistics."""
    return pb.KVCacheStats(
        num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        usage_percent=stats.usage_percent,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        recompute_queries=stats.recompute_queries,
        recompute_hits=stats.recompute_hits,
        num_requests=stats.num_requests,
        block_size=stats.block_size,
        num_evictions=stats.num_evictions,
    )


def step_to_pb(step: StepResult) -> pb.AllocateSlotsResponse:
    """A whole step's answer.

    NOTE: sub-messages are appended with ``add(**fields)``, which is ~2.5x faster than building
    each one and passing a list: a step of 64 fresh requests can evict thousands of blocks.
    """
    resp = pb.AllocateSlotsResponse(stats=stats_to_pb(step.stats))
    add_result = resp.results.add
    for r in step.results:
        add_result(
            request_id=r.request_id,
            status=_STATUS[r.status],
            new_block_ids=r.new_block_ids,
            num_computed_tokens=r.num_computed_tokens,
            num_new_tokens=r.num_new_tokens,
            num_cached_tokens=r.num_cached_tokens,
            external_block_ids=r.external_block_ids,
        )
    add_evicted = resp.evicted.add
    for e in step.evicted:
        add_evicted(block_id=e.block_id, block_hash=e.block_hash)
    return resp


def lookup_to_pb(lookup: PrefixLookup) -> pb.LookupPrefixResponse:
    """A prefix query's answer."""
    return pb.LookupPrefixResponse(
        num_cached_tokens=lookup.num_cached_tokens,
        block_ids=lookup.block_ids,
        block_hashes=lookup.block_hashes,
    )


def block_table_to_pb(table: BlockTable) -> pb.GetBlockTableResponse:
    """One request's blocks."""
    return pb.GetBlockTableResponse(
        block_ids=table.block_ids, num_tokens=table.num_tokens, block_hashes=table.block_hashes
    )


def event_to_pb(event: KVEvent) -> pb.KVEvent:
    """One KV event."""
    if isinstance(event, BlockStored):
        return pb.KVEvent(stored=pb.BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash or b"",
            block_size=event.block_size,
            num_tokens=event.num_tokens,
            block_ids=event.block_ids,
        ))
    if isinstance(event, BlockRemoved):
        return pb.KVEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes))
    if isinstance(event, AllBlocksCleared):
        return pb.KVEvent(cleared=pb.AllBlocksCleared())
    raise TypeError(f"unknown event {event!r}")


def batch_to_pb(batch: KVEventBatch) -> pb.KVEventBatch:
    """One published batch."""
    return pb.KVEventBatch(seq=batch.seq, events=[event_to_pb(e) for e in batch.events])


def cached_blocks_to_pb(snapshot: CachedBlocks, instance_id: str) -> pb.GetCachedBlocksResponse:
    """A prefix-cache snapshot, named by the instance whose sequence numbers it uses."""
    return pb.GetCachedBlocksResponse(seq=snapshot.seq, block_hashes=snapshot.block_hashes,
                                      instance_id=instance_id)
