"""Builders and snapshots shared by the kv-cache-manager unit tests.

The manager never hashes: like the scheduler, :func:`new` and :func:`running` send the hashes of
the full blocks their tokens complete (``shared.hashing`` with :data:`SEED`). They remember each
request's tokens for that (a request refused and sent again should be rebuilt with ``new``/
``running`` only once per applied allocation; :func:`forget` drops a request's record).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.kv_cache_manager.binding import ManagerBinding
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationSpec
from shared.hashing import BlockHash, hash_blocks, hash_seed

BS = 16
SEED = hash_seed(b"test-key", "test-model")
# request id -> (tokens sent so far, salt, block size): what the scheduler knows, to hash with.
_KNOWN: dict[str, tuple[list[int], bytes, int]] = {}


def hashes_of(tokens: Sequence[int], salt: bytes = b"", block_size: int = BS) -> list[BlockHash]:
    """The chained hashes of the full blocks of ``tokens``, as the scheduler computes them."""
    return hash_blocks(SEED, tokens, block_size, salt)


def make_manager(num_blocks: int = 11, block_size: int = BS, max_model_len: int = 1024,
                 hub: EventHub | None = None) -> KVCacheManager:
    """A manager with a small pool (block 0 is null, so ``num_blocks - 1`` are usable)."""
    config = CacheConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                         model_id="test-model")
    return KVCacheManager(config, hub)


OWNER = "test-owner"


def make_binding(hub: EventHub | None = None, num_blocks: int = 11) -> ManagerBinding:
    """A service-level binding initialized by :data:`OWNER` with :func:`make_manager`'s config."""
    binding = ManagerBinding(hub)
    binding.initialize(OWNER, make_manager(num_blocks).config, "pool-1", 60.0)
    return binding


def new(request_id: str, tokens: Sequence[int], num_new: int | None = None, *, salt: bytes = b"",
        block_size: int = BS, **kw: Any) -> AllocationSpec:
    """A new request's first allocation, scheduling its whole prompt unless told otherwise."""
    _KNOWN[request_id] = (list(tokens), salt, block_size)
    return AllocationSpec(request_id, tuple(tokens), len(tokens) if num_new is None else num_new,
                          is_new=True, block_hashes=tuple(hashes_of(tokens, salt, block_size)), **kw)


def running(request_id: str, new_tokens: Sequence[int], num_new: int) -> AllocationSpec:
    """A running request's allocation (decode or the next prefill chunk), with the hashes of the
    blocks ``new_tokens`` complete."""
    known, salt, block_size = _KNOWN.get(request_id, ([], b"", BS))
    tokens = [*known, *new_tokens]
    _KNOWN[request_id] = (tokens, salt, block_size)
    fresh = hashes_of(tokens, salt, block_size)[len(known) // block_size :]
    return AllocationSpec(request_id, tuple(new_tokens), num_new, block_hashes=tuple(fresh))


def forget(request_id: str) -> None:
    """Drops a request's token record (its allocation was refused: it will be sent again)."""
    _KNOWN.pop(request_id, None)


def lookup(manager: KVCacheManager, tokens: Sequence[int], salt: bytes = b"") -> int:
    """Cached tokens of ``tokens`` by the read-only lookup (hashes of all but the last token's block)."""
    bs = manager.config.block_size
    hashes = hashes_of(tokens, salt, bs)[: max(0, (len(tokens) - 1) // bs)]
    return manager.lookup_prefix(hashes).num_cached_tokens


def free_order(manager: KVCacheManager) -> list[int]:
    """Block ids in the free queue, front (allocated next) to back (evicted last)."""
    return [block.block_id for block in manager.pool.free_queue]


def snapshot(manager: KVCacheManager, request_ids: Sequence[str] = ()) -> tuple[Any, ...]:
    """Everything observable: stats, block tables, free-queue order, cached hashes -> block ids."""
    tables = {rid: manager.get_block_table(rid) for rid in request_ids}
    cached = {h: b.block_id for h, b in manager.pool.cached.items()}
    return manager.stats(), tables, free_order(manager), cached


def seq(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start`` (different starts give unrelated prompts)."""
    return list(range(start, start + n))
