"""Attention sinks (StreamingLLM) in the kv-cache-manager: the dead middle is freed, the sink blocks never.

Blocks of 16 tokens, ``SINKS`` 20 (blocks 0 and 1 hold a sink token), ``WINDOW`` 32: when a step starts
at ``p``, a block is dead when all its tokens are >= 20 and < p - 31.
"""

from __future__ import annotations

import pytest

from services.kv_cache_manager.block_pool import BlockPool
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.convert import config_from_pb, config_to_pb
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.prefix_hit import find_longest_hit
from services.kv_cache_manager.types import AllocationResult, AllocationStatus
from shared.hashing import BlockHash

from .helpers import BS, forget, free_order, hashes_of, new, running, seq

OK = AllocationStatus.OK
SINKS, WINDOW = 20, 32
A = seq(0, 100)  # 6 full blocks + 4 tokens


def make(num_blocks: int, sinks: int = SINKS, window: int = WINDOW) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=BS, max_model_len=2**31 - 1,
                                      group_windows=(window,), group_sink_tokens=(sinks,)))


def table(m: KVCacheManager, rid: str) -> list[int]:
    return list(m.get_block_table(rid).block_ids)


def test_the_middle_is_freed_the_sink_blocks_never_and_a_hit_needs_both() -> None:
    m = make(12)
    forget("a")
    assert m.step((), [new("a", A, 48)]).results[0].new_block_ids == (1, 2, 3)
    # At 48 tokens below 17 are out of the window, but block 0 and 1 hold sinks: nothing dies
    # (without sinks block 1 would: test_sliding_window.py).
    r = m.step((), [running("a", [], 48)])
    assert r.results[0] == AllocationResult("a", OK, (4, 5, 6), num_computed_tokens=48, num_new_tokens=48)
    assert table(m, "a") == [1, 2, 3, 4, 5, 6]
    # At 96: tokens 20 .. 64 are dead, so positions 2 and 3 (tokens 32..63) are; position 1 holds sinks.
    r = m.step((), [running("a", [], 4)])
    assert r.results[0].new_block_ids == (7,)
    assert table(m, "a") == [1, 2, 0, 0, 5, 6, 7]
    assert free_order(m) == [8, 9, 10, 11, 4, 3]  # hashed, freed latest first: the earliest evicted last
    assert (r.stats.num_free_blocks, r.stats.num_cached_blocks) == (6, 6)
    m.check_integrity()
    # The same prompt hits 6 blocks (96 tokens): the sink blocks 0, 1 and the window's 4, 5.
    forget("b")
    rb = m.step((), [new("b", A)]).results[0]
    assert rb == AllocationResult("b", OK, (1, 2, 0, 0, 5, 6, 8), num_computed_tokens=96, num_new_tokens=4,
                                  num_cached_tokens=96)
    m.check_integrity()
    m.free(["a", "b"])
    m.check_integrity()
    assert m.stats().num_free_blocks == 11


def _live(position: int, num_new: int, sinks: int, window: int) -> int:
    """Blocks a request holds after a step at ``position`` of ``num_new`` tokens, from the rule itself:
    every block with a token a query of this step or later can see (j < sinks or j >= position - window + 1)."""
    return len({j // BS for j in range(position + num_new) if j < sinks or j >= position - window + 1})


def test_a_stream_ten_times_the_pool_holds_exactly_its_live_blocks_at_every_step() -> None:
    m = make(7)  # 6 usable blocks, 96 tokens; the stream is 1100 tokens
    forget("s")
    prompt = seq(0, 40)
    r = m.step((), [new("s", prompt, 24)])
    assert r.results[0].status is OK
    held = [r.stats.num_blocks - r.stats.num_free_blocks]
    position, tokens = 24, 40
    while position < 1100:
        num_new = 16 if position < tokens else 1
        new_tokens = [] if position < tokens else [position % 300]
        tokens += len(new_tokens)
        r = m.step((), [running("s", new_tokens, min(num_new, tokens - position))])
        assert r.results[0].status is OK, position
        n = min(num_new, tokens - position)
        assert r.stats.num_blocks - r.stats.num_free_blocks == _live(position, n, SINKS, WINDOW), position
        held.append(r.stats.num_blocks - r.stats.num_free_blocks)
        position += n
        m.check_integrity()
    # The bound: ceil(k / bs) + ceil((W - 1 + chunk) / bs) + 1 = 2 + 3 + 1 with prefill chunks of 16.
    assert max(held) == 5 <= 6
    assert len(m.get_block_table("s").block_ids) == 1100 // BS + 1  # the table grew past the pool, zeros between


def _pool_with(cached_positions: list[int], hashes: list[BlockHash], tokens: list[int]) -> BlockPool:
    pool = BlockPool(16)
    blocks = pool.get_new_blocks(len(hashes), [])
    for i in cached_positions:
        pool.cache_block(blocks[i], hashes[i], tuple(tokens[i * BS : (i + 1) * BS]))
    pool.free_blocks(blocks)
    return pool


def test_the_hit_rule_needs_every_sink_block() -> None:
    tokens = seq(0, 100)
    hashes = hashes_of(tokens)  # 6 blocks
    # Block 0 evicted, 1..5 cached: a window alone hits all 6 (it needs 4, 5); with a sink block, nothing.
    pool = _pool_with([1, 2, 3, 4, 5], hashes, tokens)
    assert find_longest_hit(pool, (WINDOW,), hashes, tokens, 6, BS)[0] == 6
    assert find_longest_hit(pool, (WINDOW,), hashes, tokens, 6, BS, (16,))[0] == 0
    # 0, 3, 5 cached: 6 needs 4 (missing), 4 needs 2 (missing), 2 needs the sink 0 and window block 1
    # (missing), 1 needs only the sink 0: a hit of one block.
    pool = _pool_with([0, 3, 5], hashes, tokens)
    k, tables = find_longest_hit(pool, (WINDOW,), hashes, tokens, 6, BS, (16,))
    assert (k, [b.block_id for b in tables[0]]) == (1, [1])
    # 0, 1, 4, 5 cached with sinks 20 (blocks 0 and 1): 6 needs 0, 1 and 4, 5 -> the dead middle is null.
    pool = _pool_with([0, 1, 4, 5], hashes, tokens)
    k, tables = find_longest_hit(pool, (WINDOW,), hashes, tokens, 6, BS, (SINKS,))
    assert (k, [b.block_id for b in tables[0]]) == (6, [1, 2, 0, 0, 5, 6])


def test_sink_tokens_are_validated_and_travel_in_initialize() -> None:
    with pytest.raises(ValueError, match="only a window group"):
        CacheConfig(num_blocks=8, group_windows=(None,), group_sink_tokens=(4,))
    with pytest.raises(ValueError, match="one entry per KV cache group"):
        CacheConfig(num_blocks=8, group_windows=(32, 32), group_sink_tokens=(4,))
    with pytest.raises(ValueError, match=">= 0"):
        CacheConfig(num_blocks=8, group_windows=(32,), group_sink_tokens=(-1,))
    config = CacheConfig(num_blocks=8, block_size=BS, max_model_len=2**31 - 1, group_windows=(WINDOW,),
                         group_sink_tokens=(SINKS,))
    msg = config_to_pb(config, "pool-1", 30.0)
    assert (list(msg.kv_group_windows), list(msg.kv_group_sink_tokens), msg.max_model_len) == (
        [WINDOW], [SINKS], 2**31 - 1)
    assert config_from_pb(msg) == config
    plain = CacheConfig(num_blocks=8)
    assert list(config_to_pb(plain, "p", 1.0).kv_group_sink_tokens) == []
    assert config_from_pb(config_to_pb(plain, "p", 1.0)) == plain
