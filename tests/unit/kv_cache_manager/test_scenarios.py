"""Scenario tests of the kv-cache-manager core: exact block ids, free-queue order, stats, events.

Pool: 11 blocks of 16 tokens; block 0 is the null block, so blocks 1..10 are usable.
"""

from __future__ import annotations

import dataclasses

import pytest

from services.kv_cache_manager.events import EventHub, Subscription
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationResult,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
    EvictedBlock,
    KVCacheStats,
    KVEvent,
)
from shared.errors import FailedPrecondition
from shared.hashing import BlockHash

from .helpers import free_order, hashes_of, lookup, make_manager, new, running, seq, snapshot

OK = AllocationStatus.OK
A = seq(0, 55)  # 3 full blocks + 7 tokens
B = A[:48] + seq(1000, 5)  # shares A's 3 full blocks


def drain(sub: Subscription) -> list[KVEvent]:
    """Every event published so far, flattened across batches."""
    out: list[KVEvent] = []
    while (batch := sub.get(timeout=0)) is not None:
        out.extend(batch.events)
    return out


@pytest.fixture
def m() -> KVCacheManager:
    return make_manager()


def alloc_ab(m: KVCacheManager) -> tuple[AllocationResult, AllocationResult]:
    ra = m.step((), [new("a", A)]).results[0]
    rb = m.step((), [new("b", B)]).results[0]
    return ra, rb


def test_prompt_gets_blocks_and_only_full_blocks_are_cached(m: KVCacheManager) -> None:
    result = m.step((), [new("a", A)])
    assert result.results == (AllocationResult("a", OK, (1, 2, 3, 4), 0, 55, 0, ()),)
    assert result.evicted == ()
    table = m.get_block_table("a")
    assert table.block_ids == (1, 2, 3, 4)
    assert table.num_tokens == 55
    assert list(table.block_hashes) == hashes_of(A)
    assert [m.pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == [*hashes_of(A), None]
    assert m.pool.blocks[2].token_ids == tuple(A[16:32])
    assert result.stats == KVCacheStats(
        num_blocks=10, num_free_blocks=6, num_cached_blocks=3, usage_percent=40.0,
        prefix_cache_queries=55, prefix_cache_hits=0, recompute_queries=0, recompute_hits=0,
        num_requests=1, block_size=16, num_evictions=0)
    m.check_integrity()


def test_shared_prefix_hits_the_cached_blocks(m: KVCacheManager) -> None:
    _, rb = alloc_ab(m)
    assert rb == AllocationResult("b", OK, (1, 2, 3, 5), num_computed_tokens=48, num_new_tokens=5,
                                  num_cached_tokens=48)
    assert [m.pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 2, 1, 1]
    assert free_order(m) == [6, 7, 8, 9, 10]
    m.check_integrity()


def test_free_order_is_unhashed_first_then_hashed_tail_first(m: KVCacheManager) -> None:
    alloc_ab(m)
    m.free(["a"])
    # a's unhashed tail block goes to the front; its hashed blocks are still held by b.
    assert free_order(m) == [4, 6, 7, 8, 9, 10]
    m.free(["b"])
    assert free_order(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    m.check_integrity()


def test_unrelated_request_reuses_blocks_in_lru_order_and_evicts_tail_first(m: KVCacheManager) -> None:
    alloc_ab(m)
    m.step(["a", "b"], [])
    ha = hashes_of(A)
    result = m.step((), [new("c", seq(5000, 160))])
    assert result.results[0].new_block_ids == (5, 4, 6, 7, 8, 9, 10, 3, 2, 1)
    assert result.evicted == (EvictedBlock(3, ha[2]), EvictedBlock(2, ha[1]), EvictedBlock(1, ha[0]))
    assert result.stats.num_evictions == 3
    assert result.stats.num_cached_blocks == 10
    assert result.stats.num_free_blocks == 0
    m.check_integrity()


def test_partial_eviction_keeps_the_chain_head_cached(m: KVCacheManager) -> None:
    alloc_ab(m)
    m.free(["a", "b"])
    # 8 blocks: everything unhashed plus the chain's tail (block 3).
    r = m.step((), [new("c", seq(5000, 128))])
    assert r.results[0].new_block_ids == (5, 4, 6, 7, 8, 9, 10, 3)
    assert r.evicted == (EvictedBlock(3, hashes_of(A)[2]),)
    found = m.lookup_prefix(hashes_of(A))
    assert (found.num_cached_tokens, found.block_ids) == (32, (1, 2))
    m.check_integrity()


def test_fully_cached_prompt_hits_all_but_the_block_holding_the_last_token(m: KVCacheManager) -> None:
    p = seq(0, 48)
    assert m.step((), [new("p", p)]).results[0].new_block_ids == (1, 2, 3)
    m.free(["p"])
    assert free_order(m) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    r = m.step((), [new("q", p)]).results[0]
    # The last token must be computed, so the third block is recomputed in a fresh block.
    assert r == AllocationResult("q", OK, (1, 2, 4), num_computed_tokens=32, num_new_tokens=16,
                                 num_cached_tokens=32)
    # Block 3 still serves the third hash; the recomputed duplicate is not registered.
    assert m.pool.cached[hashes_of(p)[2]].block_id == 3
    assert m.pool.blocks[4].block_hash is None
    assert m.stats().num_cached_blocks == 3
    assert lookup(m, p) == 32
    assert lookup(m, [*p, 7]) == 48
    m.check_integrity()


def test_different_cache_salt_hits_nothing(m: KVCacheManager) -> None:
    m.step((), [new("a", A, salt=b"tenant-1")])
    assert lookup(m, A, b"tenant-1") == 48
    assert lookup(m, A, b"tenant-2") == 0
    assert lookup(m, A) == 0
    r = m.step((), [new("b", B, salt=b"tenant-2")]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((5, 6, 7, 8), 0)
    # The salt enters the first block, and the chain carries it to every later block.
    assert not set(hashes_of(A, b"tenant-1")) & set(hashes_of(A, b"tenant-2"))
    m.check_integrity()


def test_decode_appends_a_block_when_the_last_one_is_full(m: KVCacheManager) -> None:
    prompt = seq(0, 16)
    r = m.step((), [new("a", prompt)]).results[0]
    assert (r.new_block_ids, r.num_new_tokens) == ((1,), 16)
    assert m.pool.blocks[1].block_hash == hashes_of(prompt)[0]
    r = m.step((), [running("a", [99], 1)]).results[0]
    assert r == AllocationResult("a", OK, (2,), num_computed_tokens=16, num_new_tokens=1)
    assert m.get_block_table("a").block_ids == (1, 2)
    assert m.get_block_table("a").num_tokens == 17
    m.check_integrity()


def test_decode_registers_the_block_it_completes_under_the_hash_it_is_sent(m: KVCacheManager) -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    tokens = seq(0, 20)
    m.step((), [new("a", tokens)])
    sub = hub.subscribe()
    sent = []
    for t in range(12):  # tokens 20..31: the 12th completes block 1 (tokens 16..31)
        tokens.append(100 + t)
        spec = running("a", [100 + t], 1)
        sent.append(len(spec.block_hashes))
        m.step((), [spec])
    assert sent == [0] * 11 + [1]
    h = hashes_of(tokens)
    assert drain(sub) == [BlockStored((h[1],), h[0], 16, 16, (2,))]
    assert m.get_block_table("a").block_hashes == (h[0], h[1])
    # The manager keeps no copy of registered tokens: only the unregistered tail (none here).
    assert m._requests["a"].tail_token_ids == []
    m.check_integrity()


def test_the_manager_keys_on_the_hashes_it_is_sent_it_never_hashes(m: KVCacheManager) -> None:
    forged = tuple(BlockHash(bytes([i + 1]) * 32) for i in range(3))
    r = m.step((), [dataclasses.replace(new("a", A), block_hashes=forged)])
    assert r.results[0].new_block_ids == (1, 2, 3, 4)
    assert {h: b.block_id for h, b in m.pool.cached.items()} == {forged[0]: 1, forged[1]: 2, forged[2]: 3}
    assert m.get_block_table("a").block_hashes == forged
    m.check_integrity()


def test_chunked_prefill_caches_each_chunk_as_it_is_computed(m: KVCacheManager) -> None:
    p = seq(0, 100)
    r1 = m.step((), [new("a", p, num_new=32)]).results[0]
    assert (r1.new_block_ids, r1.num_computed_tokens, r1.num_new_tokens) == ((1, 2), 0, 32)
    assert m.stats().num_cached_blocks == 2
    r2 = m.step((), [running("a", [], 40)]).results[0]
    assert (r2.new_block_ids, r2.num_computed_tokens, r2.num_new_tokens) == ((3, 4, 5), 32, 40)
    assert m.stats().num_cached_blocks == 4  # tokens 0..71: 4 full blocks computed
    r3 = m.step((), [running("a", [], 28)]).results[0]
    assert (r3.new_block_ids, r3.num_computed_tokens, r3.num_new_tokens) == ((6, 7), 72, 28)
    assert m.stats().num_cached_blocks == 6
    m.check_integrity()


def test_new_request_schedules_at_most_its_known_tokens(m: KVCacheManager) -> None:
    r = m.step((), [new("a", seq(0, 20), num_new=500)]).results[0]
    assert (r.new_block_ids, r.num_new_tokens) == ((1, 2), 20)


def test_out_of_blocks_changes_nothing(m: KVCacheManager) -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    m.step((), [new("x", seq(500, 100))])  # 7 blocks: 1..7
    sub = hub.subscribe()
    before = snapshot(m, ["x"])
    result = m.step((), [new("big", seq(0, 64))])  # 4 blocks, 3 free
    assert result.results == (AllocationResult("big", AllocationStatus.OUT_OF_BLOCKS),)
    result = m.step((), [running("x", seq(600, 70), 70)])  # needs 4 more blocks
    assert result.results == (AllocationResult("x", AllocationStatus.OUT_OF_BLOCKS),)
    assert result.evicted == ()
    assert snapshot(m, ["x"]) == before
    assert drain(sub) == []
    m.check_integrity()
    # The failed decode did not keep its tokens: the same tokens can be sent again.
    r = m.step((), [running("x", seq(600, 13), 13)]).results[0]
    assert (r.new_block_ids, r.num_computed_tokens) == ((8,), 100)
    assert m.get_block_table("x").num_tokens == 113


def test_out_of_blocks_counts_free_hit_blocks_as_taken() -> None:
    m = make_manager()
    a = seq(0, 64)
    m.step((), [new("a", a)])  # blocks 1..4, all cached
    m.free(["a"])
    m.step((), [new("x", seq(500, 80))])  # takes 5..9
    assert free_order(m) == [10, 4, 3, 2, 1]
    before = snapshot(m, ["x"])
    # 81 tokens: 4 hit blocks (all free) + 2 fresh; only 1 free block is not a hit.
    r = m.step((), [new("q", [*a, *seq(900, 17)])]).results[0]
    assert r.status is AllocationStatus.OUT_OF_BLOCKS
    assert snapshot(m, ["x"]) == before
    # 65 tokens: 4 hits + 1 fresh fits exactly.
    r = m.step((), [new("q", [*a, 900])]).results[0]
    assert r == AllocationResult("q", OK, (1, 2, 3, 4, 10), 64, 1, 64)
    assert m.stats().num_free_blocks == 0
    m.check_integrity()


def test_each_allocation_of_a_step_succeeds_or_fails_on_its_own(m: KVCacheManager) -> None:
    result = m.step((), [new("a", seq(0, 64)), new("b", seq(100, 200)), new("c", seq(400, 32))])
    assert [(r.request_id, r.status, r.new_block_ids) for r in result.results] == [
        ("a", OK, (1, 2, 3, 4)), ("b", AllocationStatus.OUT_OF_BLOCKS, ()), ("c", OK, (5, 6))]
    assert result.stats.num_requests == 2
    m.check_integrity()


def test_hash_collision_is_a_miss(m: KVCacheManager) -> None:
    # Two sequences of the same length sent with the same hashes: a forced collision.
    colliding = tuple(BlockHash(bytes([i]) * 32) for i in range(2))
    m.step((), [dataclasses.replace(new("a", seq(0, 40)), block_hashes=colliding)])
    r = m.step((), [dataclasses.replace(new("b", seq(100, 40)), block_hashes=colliding)]).results[0]
    assert r == AllocationResult("b", OK, (4, 5, 6), 0, 40, 0)
    # The read-only lookup is by hash alone (it hands out no KV): it sees a's two blocks.
    assert m.lookup_prefix(colliding).num_cached_tokens == 32
    # b's blocks collide with a's registered hashes, so they stay unregistered.
    assert m.pool.cached[BlockHash(bytes([0]) * 32)].block_id == 1
    assert m.pool.blocks[4].block_hash is None
    m.check_integrity()


def test_collision_on_a_later_block_ends_the_hit_there(m: KVCacheManager) -> None:
    m.step((), [new("a", A)])
    # Forge block 2's stored tokens, as if another sequence had produced its hash.
    m.pool.blocks[2].token_ids = tuple(range(7, 23))
    assert lookup(m, A) == 48  # by hash alone; reusing the blocks compares their tokens:
    r = m.step((), [new("b", B)]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((1, 5, 6, 7), 16)


def test_stats_count_queries_hits_and_recompute_exactly(m: KVCacheManager) -> None:
    alloc_ab(m)
    s = m.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.recompute_queries, s.recompute_hits) == (108, 48, 0, 0)
    # b is preempted (freed) and resumes: its hit counts as recompute.
    r = m.step(["b"], [new("b", B, is_resumed=True)]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((1, 2, 3, 5), 48)
    s = m.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.recompute_queries, s.recompute_hits) == (108, 48, 53, 48)
    # A request that opts out of reading the cache is not a query, and hits nothing.
    r = m.step((), [new("c", A, use_prefix_cache=False)]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((6, 7, 8, 9), 0)
    s = m.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.recompute_queries, s.recompute_hits) == (108, 48, 53, 48)
    assert (s.num_requests, s.num_free_blocks, s.usage_percent, s.num_cached_blocks) == (3, 1, 90.0, 3)
    m.check_integrity()


def test_events_stored_removed_cleared() -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    m.step((), [new("early", seq(700, 16))])  # before anyone subscribed: not delivered
    sub = hub.subscribe()
    m.free(["early"])
    m.initialize(m.config)  # a fresh pool forgets everything cached
    assert drain(sub) == [AllBlocksCleared()]
    ha = hashes_of(A)
    m.step((), [new("a", A)])
    m.step((), [new("b", B)])  # no new full block: no event, no batch
    batch = sub.get(timeout=0)
    assert batch is not None
    assert batch.events == (BlockStored(tuple(ha), None, 16, 48, (1, 2, 3)),)
    assert sub.get(timeout=0) is None
    m.free(["a", "b"])
    c = seq(5000, 160)
    m.step((), [new("c", c)])
    batch2 = sub.get(timeout=0)
    assert batch2 is not None and batch2.seq == batch.seq + 1
    hc = hashes_of(c)
    assert batch2.events == (
        BlockRemoved((ha[2], ha[1], ha[0])),
        BlockStored(tuple(hc), None, 16, 160, (5, 4, 6, 7, 8, 9, 10, 3, 2, 1)),
    )
    m.free(["c"])
    assert m.reset_prefix_cache() == 10
    assert drain(sub) == [AllBlocksCleared()]


def test_stored_event_names_the_parent_of_a_continued_chain() -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    m.step((), [new("a", seq(0, 32))])
    sub = hub.subscribe()
    p = seq(0, 64)
    h = hashes_of(p)
    m.step((), [new("b", p)])  # hits block 1 (cap: 63 tokens -> 3 blocks, 2 cached)
    assert drain(sub) == [BlockStored((h[2], h[3]), h[1], 16, 32, (3, 4))]


def test_duplicate_computed_concurrently_keeps_the_existing_mapping() -> None:
    hub = EventHub()
    m = make_manager(hub=hub)
    p = seq(0, 64)
    h = hashes_of(p)
    m.step((), [new("r1", p, num_new=16)])  # chunked: computes block 0 only -> block 1
    r2 = m.step((), [new("r2", p)]).results[0]  # hits block 1, computes the rest in 2, 3, 4
    assert (r2.new_block_ids, r2.num_cached_tokens) == ((1, 2, 3, 4), 16)
    sub = hub.subscribe()
    r1 = m.step((), [running("r1", [], 48)]).results[0]  # computes blocks 1..3 again in 5, 6, 7
    assert r1.new_block_ids == (5, 6, 7)
    assert [m.pool.cached[x].block_id for x in h] == [1, 2, 3, 4]
    assert drain(sub) == []
    m.free(["r1"])
    # r1's unregistered duplicates hold nothing reusable: front of the queue, tail first.
    assert free_order(m) == [5, 6, 7, 8, 9, 10]
    m.check_integrity()


def test_reset_prefix_cache_refused_while_blocks_are_in_use(m: KVCacheManager) -> None:
    m.step((), [new("a", A)])
    with pytest.raises(FailedPrecondition):
        m.reset_prefix_cache()
    assert m.stats().num_cached_blocks == 3
    m.free(["a"])
    assert m.reset_prefix_cache() == 3
    assert m.stats().num_cached_blocks == 0
    assert lookup(m, A) == 0
    assert free_order(m) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    m.check_integrity()


def test_evicted_blocks_are_reported_in_step_order(m: KVCacheManager) -> None:
    m.step((), [new("a", seq(0, 48)), new("b", seq(100, 48))])  # a: 1,2,3  b: 4,5,6
    m.free(["a", "b"])
    assert free_order(m) == [7, 8, 9, 10, 3, 2, 1, 6, 5, 4]
    result = m.step((), [new("c", seq(200, 80)), new("d", seq(300, 64))])
    assert [r.new_block_ids for r in result.results] == [(7, 8, 9, 10, 3), (2, 1, 6, 5)]
    ha, hb = hashes_of(seq(0, 48)), hashes_of(seq(100, 48))
    assert result.evicted == (EvictedBlock(3, ha[2]), EvictedBlock(2, ha[1]), EvictedBlock(1, ha[0]),
                              EvictedBlock(6, hb[2]), EvictedBlock(5, hb[1]))
    assert result.stats.num_evictions == 5
    m.check_integrity()


def test_external_blocks_are_allocated_counted_as_computed_and_cached(m: KVCacheManager) -> None:
    p = seq(0, 80)
    m.step((), [new("a", seq(0, 40))])  # caches p's first 2 blocks in 1, 2
    r = m.step((), [new("b", p, num_external_blocks=4)]).results[0]
    assert r == AllocationResult("b", OK, (1, 2, 4, 5, 6), num_computed_tokens=64, num_new_tokens=16,
                                 num_cached_tokens=32, external_block_ids=(4, 5))
    h = hashes_of(p)
    assert [m.pool.cached[x].block_id for x in h] == [1, 2, 4, 5, 6]
    assert m.stats().prefix_cache_hits == 32
    m.check_integrity()


def test_external_blocks_obey_the_last_token_cap_and_the_pool_hit(m: KVCacheManager) -> None:
    p = seq(0, 80)
    r = m.step((), [new("a", p, num_external_blocks=9)]).results[0]
    assert (r.num_computed_tokens, r.num_new_tokens, r.external_block_ids) == (64, 16, (1, 2, 3, 4))
    r = m.step((), [new("b", seq(0, 40), num_external_blocks=1)]).results[0]
    # The pool already covers more than the external tier: nothing to load.
    assert (r.new_block_ids, r.num_cached_tokens, r.external_block_ids) == ((1, 2, 6), 32, ())
    m.check_integrity()


def test_initialize_recreates_the_pool_for_new_geometry_and_frees_live_requests(m: KVCacheManager) -> None:
    m.step((), [new("a", A)])
    stats, kept, freed = m.initialize(dataclasses.replace(m.config, num_blocks=21, block_size=8), keep_cache=True)
    assert (kept, freed) == (False, 1)  # other geometry: the cache cannot be kept
    assert (stats.num_blocks, stats.num_free_blocks, stats.block_size, stats.num_cached_blocks) == (20, 20, 8, 0)
    assert (stats.num_requests, stats.prefix_cache_queries) == (0, 0)
    r = m.step((), [new("a", A, block_size=8)]).results[0]
    assert r.new_block_ids == (1, 2, 3, 4, 5, 6, 7)
    m.check_integrity()


def test_initialize_keeping_the_cache_rolls_back_allocations_that_may_not_have_run(m: KVCacheManager) -> None:
    """A re-bind frees every live request; only blocks whose step is known to have run stay cached."""
    m.step((), [new("a", A)])
    m.step((), [running("a", [7], 1)])  # a's first allocation ran: blocks 1-3 hold A's KV
    m.step((), [new("c", seq(500, 40))])  # c's allocation never ran: its 2 full blocks hold nothing
    stats, kept, freed = m.initialize(m.config, keep_cache=True)
    assert (kept, freed) == (True, 2)
    assert (stats.num_requests, stats.num_free_blocks, stats.num_cached_blocks) == (0, 10, 3)
    assert lookup(m, A) == 48
    assert lookup(m, seq(500, 40)) == 0
    m.check_integrity()
    _, kept, freed = m.initialize(m.config)  # another runner pool: nothing survives
    assert (kept, freed, lookup(m, A)) == (False, 0, 0)


def test_a_request_freed_and_renewed_in_one_step(m: KVCacheManager) -> None:
    m.step((), [new("a", A)])
    r = m.step(["a"], [new("a", A)]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((1, 2, 3, 4), 48)
    m.check_integrity()


def test_rollback_of_a_new_request_unregisters_what_it_never_computed() -> None:
    """A request admitted and released in the same step: its hit stays, its own blocks go."""
    hub = EventHub()
    m = make_manager(hub=hub)
    m.step((), [new("a", seq(0, 40))])  # caches blocks 1, 2
    m.free(["a"])
    sub = hub.subscribe()
    p = seq(0, 80)
    r = m.step((), [new("b", p, num_external_blocks=3)]).results[0]
    # a's unhashed tail block 3 was reused first.
    assert (r.new_block_ids, r.num_cached_tokens, r.external_block_ids) == ((1, 2, 3, 4, 5), 32, (3,))
    h = hashes_of(p)
    assert [m.pool.cached[x].block_id for x in h] == [1, 2, 3, 4, 5]
    m.free([], rollback_request_ids=["b"])
    # The pool hit (1, 2) held its KV before b came; 3 (external, never loaded) and 4, 5 (never
    # computed) are unregistered and go to the front of the free queue like any unhashed block.
    assert sorted(m.pool.cached[x].block_id for x in h if x in m.pool.cached) == [1, 2]
    assert free_order(m) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert drain(sub)[-1] == BlockRemoved((h[2], h[3], h[4]))
    r = m.step((), [new("c", p)]).results[0]
    assert (r.new_block_ids, r.num_cached_tokens) == ((1, 2, 3, 4, 5), 32)
    m.check_integrity()


def test_rollback_of_a_running_request_keeps_blocks_from_steps_that_ran(m: KVCacheManager) -> None:
    p = seq(0, 47)
    m.step((), [new("a", p)])  # blocks 1, 2 cached; block 3 holds 15 tokens
    m.step((), [running("a", [900], 1)])  # the 48th token completes block 3: registered now
    h = hashes_of([*p, 900])
    assert [m.pool.cached[x].block_id for x in h] == [1, 2, 3]
    m.step([], [], rollback_request_ids=["a"])  # preempted in that same step: token 48 never ran
    assert h[2] not in m.pool.cached
    assert [m.pool.cached[x].block_id for x in h[:2]] == [1, 2]
    assert free_order(m)[0] == 3
    m.check_integrity()


def test_a_plain_free_keeps_the_last_steps_blocks_cached(m: KVCacheManager) -> None:
    p = seq(0, 47)
    m.step((), [new("a", p)])
    m.step((), [running("a", [900], 1)])
    m.free(["a"])
    assert [m.pool.cached[x].block_id for x in hashes_of([*p, 900])] == [1, 2, 3]
    m.check_integrity()
