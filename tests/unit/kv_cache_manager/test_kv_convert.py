"""Both directions of every kv-cache-manager message (convert.py): a round trip returns the value."""

from __future__ import annotations

import pytest

from services.kv_cache_manager import convert
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
    BlockTable,
    EvictedBlock,
    KVCacheStats,
    KVEventBatch,
    PrefixLookup,
    StepResult,
)
from shared.hashing import BlockHash

H = [BlockHash(bytes([i]) * 32) for i in range(3)]
STATS = KVCacheStats(num_blocks=10, num_free_blocks=4, num_cached_blocks=3, usage_percent=60.0,
                     prefix_cache_queries=55, prefix_cache_hits=48, recompute_queries=7, recompute_hits=4,
                     num_requests=2, block_size=16, num_evictions=1)


def test_allocation_round_trips_with_its_hashes() -> None:
    spec = AllocationSpec("a", (1, 2, 3), 3, is_new=True, use_prefix_cache=False, is_resumed=True,
                          num_external_blocks=2, block_hashes=tuple(H))
    assert convert.spec_from_pb(convert.spec_to_pb(spec)) == spec


def test_step_answer_round_trips() -> None:
    step = StepResult(
        results=(AllocationResult("a", AllocationStatus.OK, (1, 2), 16, 5, 16, (2,)),
                 AllocationResult("b", AllocationStatus.OUT_OF_BLOCKS)),
        evicted=(EvictedBlock(7, H[0]),), stats=STATS)
    assert convert.step_from_pb(convert.step_to_pb(step)) == step
    assert convert.stats_from_pb(convert.stats_to_pb(STATS)) == STATS


def test_initialize_carries_geometry_pool_and_lease_but_no_seed() -> None:
    config = CacheConfig(num_blocks=11, block_size=4, max_model_len=64, model_id="m")
    msg = convert.config_to_pb(config, "pool-1", 2.5)
    assert (msg.pool_id, msg.lease_seconds) == ("pool-1", 2.5)
    assert convert.config_from_pb(msg) == config
    assert "hash_seed" not in msg.DESCRIPTOR.fields_by_name
    assert list(msg.kv_group_windows) == []  # one full group: the message of an all-full model is unchanged


def test_initialize_carries_the_group_windows_and_refuses_a_negative_one() -> None:
    config = CacheConfig(num_blocks=11, block_size=4, max_model_len=64, model_id="m", group_windows=(None, 16, 32))
    msg = convert.config_to_pb(config, "pool-1", 2.5)
    assert list(msg.kv_group_windows) == [0, 16, 32]
    assert convert.config_from_pb(msg) == config
    msg.kv_group_windows[1] = -1
    with pytest.raises(ValueError, match="a window must be >= 0"):
        convert.config_from_pb(msg)


def test_lookup_table_and_events_round_trip() -> None:
    assert convert.lookup_from_pb(convert.lookup_to_pb(PrefixLookup(32, (1, 2)))) == PrefixLookup(32, (1, 2))
    table = BlockTable((1, 2, 3), 40, tuple(H[:2]))
    assert convert.block_table_from_pb(convert.block_table_to_pb(table)) == table
    batch = KVEventBatch(9, (BlockStored(tuple(H[1:]), H[0], 16, 32, (4, 5)), BlockStored((H[0],), None, 16, 16, (1,)),
                             BlockRemoved((H[2],)), AllBlocksCleared()))
    assert convert.batch_from_pb(convert.batch_to_pb(batch)) == batch
