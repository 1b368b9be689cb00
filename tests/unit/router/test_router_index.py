"""The router's prefix index: exact contents after each kind of event, gaps refused, and (against
a real in-process kv-cache-manager under churn) equal to the pool's own hash map."""

from __future__ import annotations

import random

from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from services.router.index import PrefixIndex
from shared.hashing import BlockHash
from tests.unit.kv_cache_manager.helpers import make_manager, new, running


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def stored(*ids: int) -> BlockStored:
    return BlockStored(tuple(h(i) for i in ids), None, 4, 4 * len(ids), tuple(ids))


def test_stored_removed_cleared_change_exactly_their_replica() -> None:
    index = PrefixIndex()
    assert index.apply("a", KVEventBatch(7, (stored(1, 2, 3),)))
    assert index.apply("b", KVEventBatch(1, (stored(1, 2),)))
    assert index.match([h(1), h(2), h(3), h(4)], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    assert index.apply("a", KVEventBatch(8, (BlockRemoved((h(2),)),)))
    # The chain stops at the first miss even though a still holds block 3.
    assert index.match([h(1), h(2), h(3)], ["a", "b"]) == {"a": 1, "b": 2}
    assert index.blocks("a") == {h(1), h(3)} and index.blocks("b") == {h(1), h(2)}
    assert index.apply("b", KVEventBatch(2, (AllBlocksCleared(), stored(5))))
    assert index.blocks("b") == {h(5)} and index.blocks("a") == {h(1), h(3)}
    assert index.match([h(1)], ["a", "b"]) == {"a": 1, "b": 0}
    assert (index.last_seq("a"), index.last_seq("b"), index.last_seq("c")) == (8, 2, 0)


def test_a_gap_is_refused_and_changes_nothing() -> None:
    index = PrefixIndex()
    assert index.apply("a", KVEventBatch(3, (stored(1),)))
    assert not index.apply("a", KVEventBatch(5, (stored(2),)))  # batch 4 was lost
    assert not index.apply("a", KVEventBatch(3, (stored(2),)))  # a replay is a gap too
    assert index.blocks("a") == {h(1)} and index.last_seq("a") == 3
    index.clear_replica("a")  # what the client does before resubscribing
    assert index.blocks("a") == frozenset() and index.last_seq("a") == 0
    assert index.match([h(1)], ["a"]) == {"a": 0}
    assert index.apply("a", KVEventBatch(40, (stored(2),)))  # any number starts a new stream
    assert index.blocks("a") == {h(2)}


def test_clearing_one_replica_keeps_the_others_copy() -> None:
    index = PrefixIndex()
    index.apply("a", KVEventBatch(1, (stored(1, 2),)))
    index.apply("b", KVEventBatch(1, (stored(1, 2),)))
    index.clear_replica("a")
    assert index.match([h(1), h(2)], ["a", "b"]) == {"a": 0, "b": 2}
    index.apply("b", KVEventBatch(2, (BlockRemoved((h(1), h(2))),)))
    assert index.match([h(1), h(2)], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.num_blocks("b") == 0


def test_index_equals_a_real_pool_after_churn() -> None:
    """Two in-process kv-cache-managers with small pools, random shared-prefix traffic (evictions,
    frees, a reset): each replica's index entries equal its pool's hash map exactly."""
    rng = random.Random(5)
    index = PrefixIndex()
    managers, subs = {}, {}
    for rid in ("a", "b"):
        hub = EventHub()
        managers[rid] = make_manager(num_blocks=13, block_size=4, hub=hub)
        subs[rid] = hub.subscribe()
    prefixes = [[p * 100 + i for i in range(12)] for p in range(1, 6)]
    evictions = 0
    for step in range(120):
        rid = rng.choice(("a", "b"))
        m = managers[rid]
        rq = f"q{step}"
        tokens = rng.choice(prefixes) + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]
        res = m.step([], [new(rq, tokens, block_size=4)])
        evictions += len(res.evicted)
        if res.results[0].status.name == "OK":
            m.step([], [running(rq, [7], 1)])
            m.free([rq])
        if step == 60:
            managers["b"].reset_prefix_cache()
        for r, sub in subs.items():
            while (batch := sub.get(timeout=0)) is not None:
                assert index.apply(r, batch)
    assert evictions > 10  # the pools really churned
    for rid, m in managers.items():
        assert index.blocks(rid) == set(m.pool.cached), rid
        m.check_integrity()


def test_replace_sets_a_replicas_entries_and_the_next_batch_number() -> None:
    index = PrefixIndex()
    index.apply("a", KVEventBatch(3, (stored(1, 2),)))
    index.apply("b", KVEventBatch(1, (stored(2),)))
    index.replace("a", [h(2), h(4)], 9)  # the snapshot as of batch 9
    assert index.blocks("a") == {h(2), h(4)} and index.blocks("b") == {h(2)} and index.last_seq("a") == 9
    assert index.match([h(1)], ["a", "b"]) == {"a": 0, "b": 0}
    assert not index.apply("a", KVEventBatch(9, (stored(5),)))  # already in the snapshot: refused
    assert index.apply("a", KVEventBatch(10, (BlockRemoved((h(2),)),)))
    assert index.blocks("a") == {h(4)} and index.match([h(2)], ["a", "b"]) == {"a": 0, "b": 1}
    index.replace("a", [], 11)
    assert index.num_blocks("a") == 0 and index.match([h(4)], ["a"]) == {"a": 0}


def test_predictions_count_in_match_only_until_stored_expired_or_cleared() -> None:
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0])
    index.apply("a", KVEventBatch(1, (stored(1),)))
    index.predict("a", [h(1), h(2), h(3)], 5.0)
    index.predict("b", [h(1)], 5.0)
    assert index.match([h(1), h(2), h(3), h(4)], ["a", "b"]) == {"a": 3, "b": 1}
    assert index.blocks("a") == {h(1)} and index.num_blocks("b") == 0  # the real view
    # Stored: confirmed (no longer a prediction), then removed: gone, not kept alive by it.
    assert index.apply("a", KVEventBatch(2, (stored(2),)))
    assert index.apply("a", KVEventBatch(3, (BlockRemoved((h(2),)),)))
    assert index.match([h(1), h(2), h(3)], ["a"]) == {"a": 1}
    now[0] = 4.9
    assert index.match([h(1), h(3)], ["b"]) == {"b": 1}
    now[0] = 5.0  # lapsed
    assert index.match([h(1)], ["b"]) == {"b": 0}
    index.predict("a", [h(1), h(5)], 5.0)  # h(1) is held already: only h(5) is predicted
    index.clear_replica("a")  # the stream is down: claim nothing, predictions included
    assert index.match([h(1)], ["a"]) == {"a": 0} and index.match([h(5)], ["a"]) == {"a": 0}
