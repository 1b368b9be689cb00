"""DramTier: exact LRU order, whole-block budget, demotion before a slot is reused."""

from __future__ import annotations

import pytest
import torch

from services.offload_store.dram_tier import DramTier
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash

FMT = BlockFormat("float32", (1, 2, 1, 1, 2), 16)


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


class Sink:
    """Records demoted blocks with a copy of their bytes as they were at demotion time."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[BlockHash, bytes]]] = []

    def __call__(self, items: list[tuple[BlockHash, BlockFormat, torch.Tensor]]) -> None:
        self.batches.append([(bh, bytes(row.numpy().tobytes())) for bh, _, row in items])


def put(tier: DramTier, i: int) -> None:
    rows = tier.reserve([(h(i), FMT)])
    assert rows is not None
    rows[0].fill_(i)


def make(capacity: int = 3 * 16) -> tuple[DramTier, Sink]:
    sink = Sink()
    tier = DramTier(capacity, demote=sink)
    tier.configure(16, pin=False)
    return tier, sink


def test_budget_is_whole_blocks() -> None:
    assert make(3 * 16 + 15)[0].num_slots == 3
    assert make(15)[0].num_slots == 0
    tier, _ = make(0)
    assert tier.num_slots == 0
    assert tier.reserve([(h(1), FMT)]) is None


def test_lru_order_and_demotion_of_the_least_recent() -> None:
    tier, sink = make()
    for i in (1, 2, 3):
        put(tier, i)
    assert list(tier) == [h(1), h(2), h(3)]
    assert [tier.peek(h(i)).slot for i in (1, 2, 3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert tier.get(h(1)) is not None  # a hit makes 1 the most recent
    assert tier.peek(h(2)) is not None  # peek does not
    assert list(tier) == [h(2), h(3), h(1)]
    put(tier, 4)
    assert sink.batches == [[(h(2), bytes([2]) * 16)]]  # demoted with its bytes intact
    assert list(tier) == [h(3), h(1), h(4)]
    assert tier.peek(h(4)).slot == 1  # type: ignore[union-attr]  # 2's slot, reused
    assert tier.used_bytes == 48 and len(tier) == 3


def test_one_reservation_evicts_a_batch_in_lru_order() -> None:
    tier, sink = make()
    for i in (1, 2, 3):
        put(tier, i)
    rows = tier.reserve([(h(7), FMT), (h(8), FMT)])
    assert sink.batches == [[(h(1), bytes([1]) * 16), (h(2), bytes([2]) * 16)]]
    assert rows is not None and len(rows) == 2
    assert list(tier) == [h(3), h(7), h(8)]


def test_protected_blocks_are_skipped_by_eviction() -> None:
    tier, sink = make()
    for i in (1, 2, 3):
        put(tier, i)
    assert tier.reserve([(h(4), FMT)], protect={h(1)}) is not None
    assert sink.batches == [[(h(2), bytes([2]) * 16)]]  # 1 is older, but protected
    assert list(tier) == [h(1), h(3), h(4)]
    assert tier.reserve([(h(5), FMT)], protect={h(1), h(3), h(4)}) is None  # no room: nothing changes
    assert tier.reserve([(h(i), FMT) for i in (5, 6, 7, 8)]) is None  # more than the slots
    assert list(tier) == [h(1), h(3), h(4)] and len(sink.batches) == 1


def test_reserving_an_existing_hash_replaces_it_without_demotion() -> None:
    tier, sink = make()
    put(tier, 1)
    put(tier, 2)
    put(tier, 1)
    assert sink.batches == []
    assert list(tier) == [h(2), h(1)]
    assert len(tier) == 2


def test_discard_frees_the_slot_without_demotion() -> None:
    tier, sink = make()
    for i in (1, 2, 3):
        put(tier, i)
    assert tier.discard(h(2)) is True
    assert tier.discard(h(2)) is False
    put(tier, 4)
    assert sink.batches == []
    assert list(tier) == [h(1), h(3), h(4)]


def test_a_new_block_size_demotes_everything_first() -> None:
    tier, sink = make(64)
    for i in (1, 2, 3):
        put(tier, i)
    tier.get(h(1))
    tier.configure(32, pin=False)
    assert [bh for bh, _ in sink.batches[0]] == [h(2), h(3), h(1)]
    assert len(tier) == 0 and tier.num_slots == 2 and tier.slot_bytes == 32
    tier.configure(32, pin=False)  # same geometry: nothing happens
    assert len(sink.batches) == 1


def test_a_block_of_another_size_is_refused() -> None:
    tier, _ = make()
    with pytest.raises(ValueError, match="block of 32 bytes in 16-byte slots"):
        tier.reserve([(h(1), BlockFormat("float32", (1, 2, 1, 1, 4), 32))])


def test_a_failed_demotion_loses_the_blocks_but_not_the_slots() -> None:
    def failing(_: list[tuple[BlockHash, BlockFormat, torch.Tensor]]) -> None:
        raise OSError("disk full")

    tier = DramTier(32, demote=failing)
    tier.configure(16, pin=False)
    tier.reserve([(h(1), FMT), (h(2), FMT)])
    with pytest.raises(OSError, match="disk full"):
        tier.reserve([(h(3), FMT)])
    assert list(tier) == [h(2)]  # the victim is gone, its slot is free again, h(3) never went in
    tier.reserve([(h(4), FMT)])
    assert list(tier) == [h(2), h(4)]
