"""Plain data of the offload-store core (no grpc, no torch).

Mirrors ``proto/kvmesh/v1/offload_store.proto``; the servicer converts between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shared.hashing import BlockHash


@dataclass(frozen=True)
class BlockFormat:
    """What one stored block's bytes mean: the pool dtype and the block's shape in elements.

    ``shape`` is ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (``[num_layers, 1,
    block_size, 1, latent + rope]`` for an MLA pool, docs/mla.md). Two pools with the same
    format can exchange blocks byte for byte; a block of another format is never loaded (an fp16
    block has the same size as a bf16 one, so the size alone does not decide).
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def shape_text(self) -> str:
        """``"30,2,16,3,64"``: the portable text form stored in the index."""
        return ",".join(str(d) for d in self.shape)

    @staticmethod
    def parse_shape(text: str) -> tuple[int, ...]:
        """Inverse of :meth:`shape_text`."""
        return tuple(int(d) for d in text.split(",")) if text else ()


class LookupResult(NamedTuple):
    """The longest leading run of hashes the store holds."""

    num_present: int  # leading hashes present in any tier
    num_in_dram: int  # of those, how many are in DRAM


class SaveResult(NamedTuple):
    """Outcome of copying pool blocks into the store.

    ``num_saved + num_skipped`` falls short of the blocks asked for only when a block fits in
    neither tier (DRAM disabled and a disk budget smaller than the batch); see ``stats().dropped``.
    """

    num_saved: int
    num_skipped: int  # already present: nothing copied


class LoadResult(NamedTuple):
    """Outcome of copying stored blocks into pool blocks.

    The first ``num_loaded`` requested blocks were written; the load stopped at the first failure,
    whose hash is the only entry of ``failed_hashes`` (the blocks after it were not attempted: their
    prefix is broken, so the caller recomputes them anyway).
    """

    num_loaded: int
    failed_hashes: list[BlockHash]


@dataclass
class OffloadStats:
    """Tier usage and counters (see ``OffloadStats`` in the proto)."""

    dram_blocks: int = 0
    dram_bytes: int = 0
    dram_capacity_bytes: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    dram_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    saves: int = 0
    corruptions: int = 0
    # Not in the proto (yet): blocks dropped because neither tier had room for them.
    dropped: int = 0
    pool_attached: bool = False
    pool_generation: str = ""  # the mapped pool's incarnation
    refused_no_pool: int = 0  # Save / Load calls refused because no pool was attached


TIERS = ("dram", "disk", "remote")  # the tiers an event names (OffloadTier in the proto)


@dataclass(frozen=True)
class TierEvent:
    """Event: blocks entered (``stored``) or left one tier of this store.

    ``remote`` events say what THIS store wrote to the shared remote tier or saw served from it
    (docs/mesh.md, "The offload tiers in the score"): other replicas' writes appear on their own
    streams, and Redis' own evictions on none.
    """

    tier: str
    stored: bool
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class OffloadEventBatch:
    """Tier events of one store operation, in order; ``seq`` grows by one per published batch."""

    seq: int
    events: tuple[TierEvent, ...]


@dataclass(frozen=True)
class StoredBlocks:
    """The store's hashes per tier as of event batch ``seq`` (see ``GetStoredBlocksResponse``).

    NOTE: as with the pool's snapshot, a subscriber registered before it skips batches up to
    ``seq`` (already in it) and applies every later one.
    """

    seq: int
    dram: tuple[BlockHash, ...] = ()
    disk: tuple[BlockHash, ...] = ()
    remote: tuple[BlockHash, ...] = ()

    def tier(self, name: str) -> tuple[BlockHash, ...]:
        """The hashes of tier ``name`` (one of :data:`TIERS`)."""
        return {"dram": self.dram, "disk": self.disk, "remote": self.remote}[name]
