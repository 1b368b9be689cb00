"""Block tables per KV cache group: window freeing, the per-group prefix hit, rollback, events, integrity.

Blocks of 16 tokens. ``WINDOW`` 32: a query at ``p`` sees keys ``p - 31 .. p``, so when a step starts
at ``p`` a window group's blocks below ``(p - 31) // 16`` are dead and go back to the pool.
"""

from __future__ import annotations

import pytest

from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationResult, AllocationStatus, BlockStored, EvictedBlock
from shared.errors import IntegrityError, InvalidArgument

from .helpers import BS, forget, free_order, hashes_of, new, running, seq, snapshot

OK = AllocationStatus.OK
WINDOW = 32
A = seq(0, 100)  # 6 full blocks + 4 tokens


def make(num_blocks: int, windows: tuple[int | None, ...], hub: EventHub | None = None) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=BS, max_model_len=4096,
                                      group_windows=windows), hub)


def table(m: KVCacheManager, rid: str) -> list[int]:
    return list(m.get_block_table(rid).block_ids)


def test_a_window_group_frees_the_blocks_that_slid_out_of_the_window() -> None:
    m = make(11, (WINDOW,))
    forget("a")
    assert m.step((), [new("a", A, 48)]).results[0].new_block_ids == (1, 2, 3)
    # The step starts at 48: tokens below 48 - 31 = 17 are dead, so block 1 (tokens 0..15) is.
    r = m.step((), [running("a", [], 48)])
    assert r.results[0] == AllocationResult("a", OK, (4, 5, 6), num_computed_tokens=48, num_new_tokens=48)
    assert table(m, "a") == [0, 2, 3, 4, 5, 6]
    # Block 1 is hashed, so it went to the back of the free queue (evicted last), still cached.
    assert free_order(m) == [7, 8, 9, 10, 1]
    # At 96: positions 1..3 die (tokens < 65); freed latest first, so the earliest is evicted last.
    r = m.step((), [running("a", [], 4)])
    assert r.results[0].new_block_ids == (7,)
    assert table(m, "a") == [0, 0, 0, 0, 5, 6, 7]
    assert free_order(m) == [8, 9, 10, 1, 4, 3, 2]
    stats = r.stats
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_evictions) == (7, 6, 0)
    m.check_integrity()
    # The same prompt hits 6 blocks: it needs only the window before token 96 (positions 4 and 5).
    forget("b")
    rb = m.step((), [new("b", A)]).results[0]
    assert rb == AllocationResult("b", OK, (0, 0, 0, 0, 5, 6, 8), num_computed_tokens=96, num_new_tokens=4,
                                  num_cached_tokens=96)
    m.check_integrity()
    m.free(["a", "b"])
    assert free_order(m) == [8, 7, 9, 10, 1, 4, 3, 2, 6, 5]
    m.check_integrity()


def test_dead_blocks_count_as_free_and_a_refused_allocation_changes_nothing() -> None:
    m = make(5, (48,))
    forget("a")
    hashes = hashes_of(seq(0, 64))
    assert m.step((), [new("a", seq(0, 64))]).results[0].new_block_ids == (1, 2, 3, 4)
    # The pool is full; at 64 block 1 (tokens 0..15 < 64 - 47) is dead and makes room for the decode.
    r = m.step((), [running("a", [64], 1)])
    assert r.results[0].new_block_ids == (1,)
    assert r.evicted == (EvictedBlock(1, hashes[0]),)
    assert table(m, "a") == [0, 2, 3, 4, 1]
    m.check_integrity()

    m2 = make(5, (64,))
    forget("c")
    m2.step((), [new("c", seq(0, 64))])
    before = snapshot(m2, ["c"])
    # Window 64: nothing is dead at 64, the pool is full, so the decode does not fit.
    res = m2.step((), [running("c", [64], 1)]).results[0]
    assert res.status is AllocationStatus.OUT_OF_BLOCKS
    assert snapshot(m2, ["c"])[1:] == before[1:]
    m2.check_integrity()


def test_a_hybrid_model_hands_out_group_major_tables_and_frees_position_by_position() -> None:
    m = make(31, (None, WINDOW))
    forget("a")
    ra = m.step((), [new("a", A)]).results[0]
    assert ra.new_block_ids == (*range(1, 8), *range(8, 15))
    # A decode at 100: the window group's positions 0..3 die; the full group keeps every block.
    r = m.step((), [running("a", [555], 1)])
    assert r.results[0].new_block_ids == ()
    assert table(m, "a") == [*range(1, 8), 0, 0, 0, 0, 12, 13, 14]
    assert free_order(m) == [*range(15, 31), 11, 10, 9, 8]
    m.free(["a"])
    # Tail first, every group's block of a position together; unhashed tails to the front.
    assert free_order(m) == [14, 7, *range(15, 31), 11, 10, 9, 8, 6, 13, 5, 12, 4, 3, 2, 1]
    assert m.stats().num_cached_blocks == 6 + 6
    m.check_integrity()
    forget("b")
    rb = m.step((), [new("b", A)]).results[0]
    assert rb == AllocationResult("b", OK, (1, 2, 3, 4, 5, 6, 14, 0, 0, 0, 0, 12, 13, 7),
                                  num_computed_tokens=96, num_new_tokens=4, num_cached_tokens=96)
    m.check_integrity()


def test_a_full_hit_with_its_window_blocks_evicted_is_a_shorter_hit() -> None:
    m = make(30, (None, WINDOW))
    h = hashes_of(A)
    forget("a")
    m.step((), [new("a", A)])
    m.step((), [running("a", [555], 1)])  # frees window blocks 11, 10, 9, 8 (positions 3..0)
    assert free_order(m) == [*range(15, 30), 11, 10, 9, 8]
    forget("c")
    rc = m.step((), [new("c", seq(5000, 128))])
    # 16 blocks: the 15 never used, then block 11 (window group, position 3) is evicted; the
    # evicted list and the events speak of group 0 only, the counter of every group.
    assert rc.results[0].new_block_ids == (*range(15, 23), *range(23, 30), 11)
    assert (rc.evicted, rc.stats.num_evictions) == ((), 1)
    m.free(["a"])
    assert free_order(m) == [14, 7, 10, 9, 8, 6, 13, 5, 12, 4, 3, 2, 1]
    b = A[:64] + seq(7000, 20)
    # The full group has b's 4 leading blocks, but the window before token 64 needs positions 2
    # and 3 and position 3 is gone: the hit is 3 blocks (window positions 1 and 2: blocks 9, 10).
    forget("b")
    rb = m.step((), [new("b", b)])
    assert rb.results[0] == AllocationResult("b", OK, (1, 2, 3, 14, 7, 8, 0, 9, 10, 6, 13, 5),
                                             num_computed_tokens=48, num_new_tokens=36, num_cached_tokens=48)
    assert rb.evicted == (EvictedBlock(6, h[5]), EvictedBlock(5, h[4]))
    m.check_integrity()


def test_the_same_hash_is_one_block_per_group_and_lookup_uses_the_step_rule() -> None:
    m = make(31, (None, WINDOW))
    forget("a")
    m.step((), [new("a", A)])
    h = hashes_of(A)
    assert [m.pool.maps[0][x].block_id for x in h] == [1, 2, 3, 4, 5, 6]
    assert [m.pool.maps[1][x].block_id for x in h] == [8, 9, 10, 11, 12, 13]
    assert m.cached_block_hashes() == tuple(h)  # group 0's map: what the snapshot and events speak of
    found = m.lookup_prefix(h)
    assert (found.num_cached_tokens, found.block_ids) == (96, (1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 12, 13))
    m.check_integrity()


def test_rollback_unregisters_every_group_and_events_name_group_0() -> None:
    hub = EventHub()
    sub = hub.subscribe()
    m = make(31, (None, WINDOW), hub)
    h = hashes_of(A)
    forget("a")
    m.step((), [new("a", A)])
    stored = sub.get(0)
    assert stored is not None
    assert stored.events == (BlockStored(tuple(h), None, BS, 96, (1, 2, 3, 4, 5, 6)),)
    m.free([], ["a"])
    assert (m.pool.cached, m.pool.maps[1]) == ({}, {})
    # Unregistered, so every block goes to the front: the last freed (position 0) is reused first.
    assert free_order(m) == [8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, *range(15, 31)]
    removed = sub.get(0)
    assert removed is not None and [e.block_hashes for e in removed.events] == [tuple(h)]  # type: ignore[union-attr]
    m.check_integrity()


def test_external_blocks_are_refused_with_a_window_group() -> None:
    m = make(31, (None, WINDOW))
    forget("a")
    with pytest.raises(InvalidArgument, match="external blocks"):
        m.step((), [new("a", A, num_external_blocks=2)])
    assert m.stats().num_requests == 0


def test_integrity_sees_a_null_block_in_a_full_group_and_a_live_block_in_a_skipped_head() -> None:
    m = make(31, (None, WINDOW))
    forget("a")
    m.step((), [new("a", A)])
    m.step((), [running("a", [1], 1)])
    state = m._requests["a"]  # corrupting the state on purpose
    state.num_skipped[1] = 3
    with pytest.raises(IntegrityError, match="group 1 position 3 holds the null block"):
        m.check_integrity()
    state.num_skipped[1] = 4
    state.tables[0][2] = m.pool.null_block
    with pytest.raises(IntegrityError, match="group 0 position 2 holds the null block"):
        m.check_integrity()
