"""Conversions between ``offload_store.proto``'s messages and the core's types (``types.py``).

Both sides of the RPC in one place: the servicer uses the ``*_from_pb`` of requests and the
``*_to_pb`` of responses, the scheduler's client (``client.py``) the other two, so a field added
to the proto is converted once and read the same on both ends. ``ReleaseOffloadRequest`` /
``ReleaseOffloadResponse`` and ``GetOffloadStatsRequest`` carry no fields (the owner travels as
metadata), so they have nothing to convert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.offload_store.types import (
    LoadResult,
    LookupResult,
    OffloadEventBatch,
    OffloadStats,
    SaveResult,
    StoredBlocks,
    TierEvent,
)
from shared.hashing import BlockHash
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import offload_store_pb2 as pb
from shared.tensor_handle import SharedTensorHandle, handle_from_proto, handle_to_proto

Block = tuple[bytes, int]  # (block hash, pool block id)


def blocks_to_pb(blocks: Iterable[Block]) -> list[pb.BlockRef]:
    """(hash, pool block id) pairs as ``BlockRef`` messages."""
    return [pb.BlockRef(block_hash=h, block_id=b) for h, b in blocks]


def blocks_from_pb(refs: Iterable[pb.BlockRef]) -> list[Block]:
    """Inverse of :func:`blocks_to_pb`."""
    return [(r.block_hash, r.block_id) for r in refs]


# --- AttachPool ---------------------------------------------------------------------------------


def attach_to_pb(handle: SharedTensorHandle | common_pb2.SharedTensorHandle,
                 lease_seconds: float) -> pb.AttachPoolRequest:
    """The pool to map and how long this caller's ownership lasts without a call.

    ``handle`` may already be the proto: the scheduler forwards the runner's handle as it came.
    """
    pool = handle_to_proto(handle) if isinstance(handle, SharedTensorHandle) else handle
    return pb.AttachPoolRequest(pool=pool, lease_seconds=lease_seconds)


def attach_from_pb(msg: pb.AttachPoolRequest) -> tuple[SharedTensorHandle, float]:
    """The handle and the lease asked for (0 = the store's default)."""
    return handle_from_proto(msg.pool), msg.lease_seconds


def attached_to_pb(bytes_per_block: int) -> pb.AttachPoolResponse:
    """Bytes of one block of the mapped pool."""
    return pb.AttachPoolResponse(bytes_per_block=bytes_per_block)


def attached_from_pb(msg: pb.AttachPoolResponse) -> int:
    """Inverse of :func:`attached_to_pb`."""
    return int(msg.bytes_per_block)


# --- Lookup -------------------------------------------------------------------------------------


def lookup_to_pb(chains: Iterable[Sequence[bytes]]) -> pb.LookupRequest:
    """One hash chain per request of a step."""
    return pb.LookupRequest(chains=[pb.HashChain(block_hashes=c) for c in chains])


def lookup_from_pb(msg: pb.LookupRequest) -> list[list[bytes]]:
    """Inverse of :func:`lookup_to_pb`."""
    return [list(chain.block_hashes) for chain in msg.chains]


def lookup_results_to_pb(results: Sequence[LookupResult]) -> pb.LookupResponse:
    """Per chain, the leading hashes present and how many of them are in DRAM."""
    return pb.LookupResponse(num_present=[r.num_present for r in results],
                             num_in_dram=[r.num_in_dram for r in results])


def lookup_results_from_pb(msg: pb.LookupResponse) -> list[LookupResult]:
    """Inverse of :func:`lookup_results_to_pb`."""
    return [LookupResult(int(p), int(d)) for p, d in zip(msg.num_present, msg.num_in_dram, strict=True)]


# --- Save / Load --------------------------------------------------------------------------------


def save_to_pb(blocks: Iterable[Block]) -> pb.SaveRequest:
    """Pool blocks to copy into the store under their hashes."""
    return pb.SaveRequest(blocks=blocks_to_pb(blocks))


def save_from_pb(msg: pb.SaveRequest) -> list[Block]:
    """Inverse of :func:`save_to_pb`."""
    return blocks_from_pb(msg.blocks)


def saved_to_pb(result: SaveResult) -> pb.SaveResponse:
    """Blocks written and blocks already present."""
    return pb.SaveResponse(num_saved=result.num_saved, num_skipped=result.num_skipped)


def saved_from_pb(msg: pb.SaveResponse) -> SaveResult:
    """Inverse of :func:`saved_to_pb`."""
    return SaveResult(int(msg.num_saved), int(msg.num_skipped))


def load_to_pb(blocks: Iterable[Block]) -> pb.LoadRequest:
    """Stored blocks to copy into pool blocks, in order."""
    return pb.LoadRequest(blocks=blocks_to_pb(blocks))


def load_from_pb(msg: pb.LoadRequest) -> list[Block]:
    """Inverse of :func:`load_to_pb`."""
    return blocks_from_pb(msg.blocks)


def loaded_to_pb(result: LoadResult) -> pb.LoadResponse:
    """Leading blocks loaded, and the hash that failed (if one did)."""
    return pb.LoadResponse(num_loaded=result.num_loaded, failed_hashes=result.failed_hashes)


def loaded_from_pb(msg: pb.LoadResponse) -> LoadResult:
    """Inverse of :func:`loaded_to_pb`."""
    return LoadResult(int(msg.num_loaded), [BlockHash(h) for h in msg.failed_hashes])


# --- GetStats -----------------------------------------------------------------------------------


def stats_to_pb(s: OffloadStats) -> pb.OffloadStats:
    """Tier usage and counters (``dropped`` is not on the wire)."""
    return pb.OffloadStats(
        dram_blocks=s.dram_blocks, dram_bytes=s.dram_bytes, dram_capacity_bytes=s.dram_capacity_bytes,
        disk_blocks=s.disk_blocks, disk_bytes=s.disk_bytes, disk_capacity_bytes=s.disk_capacity_bytes,
        dram_hits=s.dram_hits, disk_hits=s.disk_hits, misses=s.misses, saves=s.saves,
        corruptions=s.corruptions, pool_attached=s.pool_attached, pool_generation=s.pool_generation,
        refused_no_pool=s.refused_no_pool,
    )


def stats_from_pb(msg: pb.OffloadStats) -> OffloadStats:
    """Inverse of :func:`stats_to_pb` (``dropped`` reads 0: the proto does not carry it)."""
    return OffloadStats(
        dram_blocks=msg.dram_blocks, dram_bytes=msg.dram_bytes, dram_capacity_bytes=msg.dram_capacity_bytes,
        disk_blocks=msg.disk_blocks, disk_bytes=msg.disk_bytes, disk_capacity_bytes=msg.disk_capacity_bytes,
        dram_hits=msg.dram_hits, disk_hits=msg.disk_hits, misses=msg.misses, saves=msg.saves,
        corruptions=msg.corruptions, pool_attached=msg.pool_attached, pool_generation=msg.pool_generation,
        refused_no_pool=msg.refused_no_pool,
    )


_TIER_TO_PB = {"dram": pb.OFFLOAD_TIER_DRAM, "disk": pb.OFFLOAD_TIER_DISK, "remote": pb.OFFLOAD_TIER_REMOTE}
_TIER_FROM_PB = {v: k for k, v in _TIER_TO_PB.items()}


def event_batch_to_pb(batch: OffloadEventBatch) -> pb.OffloadEventBatch:
    """One batch of tier events as sent on ``SubscribeEvents``."""
    return pb.OffloadEventBatch(seq=batch.seq, events=[
        pb.OffloadEvent(tier=_TIER_TO_PB[e.tier], stored=e.stored, block_hashes=list(e.block_hashes))
        for e in batch.events])


def event_batch_from_pb(msg: pb.OffloadEventBatch) -> OffloadEventBatch:
    """Inverse of :func:`event_batch_to_pb`; an event of an unknown tier (a newer store) is skipped."""
    return OffloadEventBatch(msg.seq, tuple(
        TierEvent(_TIER_FROM_PB[e.tier], e.stored, tuple(BlockHash(h) for h in e.block_hashes))
        for e in msg.events if e.tier in _TIER_FROM_PB))


def stored_blocks_to_pb(snap: StoredBlocks) -> pb.GetStoredBlocksResponse:
    """The tiers' snapshot as ``GetStoredBlocksResponse``."""
    return pb.GetStoredBlocksResponse(seq=snap.seq, dram_hashes=list(snap.dram), disk_hashes=list(snap.disk),
                                      remote_hashes=list(snap.remote))


def stored_blocks_from_pb(msg: pb.GetStoredBlocksResponse) -> StoredBlocks:
    """Inverse of :func:`stored_blocks_to_pb`."""
    return StoredBlocks(msg.seq, tuple(BlockHash(h) for h in msg.dram_hashes),
                        tuple(BlockHash(h) for h in msg.disk_hashes), tuple(BlockHash(h) for h in msg.remote_hashes))
