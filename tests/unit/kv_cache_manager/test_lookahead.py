"""The lookahead reserve (``num_lookahead_tokens``, async scheduling): exact blocks granted, the
reserve shrinking to nothing under pressure rather than refusing, never counted as computed or
registered, and bounded by ``max_model_len``."""

from __future__ import annotations

import dataclasses

import pytest

from services.kv_cache_manager.types import AllocationStatus
from shared.errors import InvalidArgument

from .helpers import make_manager, new, running, seq

A = seq(0, 55)  # 3 full blocks + 7 tokens


def test_a_new_request_gets_its_reserve_and_only_computed_full_blocks_are_cached() -> None:
    m = make_manager()  # 10 usable blocks of 16
    res = m.step((), [new("a", A, num_lookahead_tokens=16)]).results[0]
    # 55 tokens + 16 reserved = 71 slots: 5 blocks, computed 55, 3 full blocks registered.
    assert (res.status, res.new_block_ids, res.num_computed_tokens, res.num_new_tokens) == (
        AllocationStatus.OK, (1, 2, 3, 4, 5), 0, 55)
    stats = m.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks) == (5, 3)
    assert m.get_block_table("a").block_ids == (1, 2, 3, 4, 5)
    m.check_integrity()
    # The decode of position 55 fits the reserve: no block; 56 + 16 = 72 slots still fit 5 blocks.
    dec = dataclasses.replace(running("a", [7], 1), num_lookahead_tokens=16)
    res = m.step((), [dec]).results[0]
    assert (res.status, res.new_block_ids, res.num_computed_tokens) == (AllocationStatus.OK, (), 55)
    m.check_integrity()


def test_the_reserve_shrinks_to_nothing_under_pressure_and_never_refuses() -> None:
    m = make_manager(num_blocks=7)  # 6 usable
    a = m.step((), [new("a", A, num_lookahead_tokens=16)]).results[0]
    assert a.new_block_ids == (1, 2, 3, 4, 5)  # 2 free after its own 4: one reserved
    # b needs 1 block; after it none is free, and a live request (a) could not get one more: no reserve.
    b = m.step((), [new("b", seq(500, 16), num_lookahead_tokens=16)]).results[0]
    assert (b.status, b.new_block_ids) == (AllocationStatus.OK, (6,))
    assert m.stats().num_free_blocks == 0
    m.check_integrity()


def test_the_reserve_stops_at_max_model_len() -> None:
    m = make_manager(max_model_len=64)
    res = m.step((), [new("a", seq(0, 60), num_lookahead_tokens=16)]).results[0]
    assert res.new_block_ids == (1, 2, 3, 4)  # 64 slots, not 76
    m.check_integrity()


@pytest.mark.parametrize("lookahead", [-1, 1025])
def test_a_lookahead_outside_zero_to_max_model_len_is_invalid(lookahead: int) -> None:
    m = make_manager()
    with pytest.raises(InvalidArgument, match="num_lookahead_tokens must be in"):
        m.step((), [new("a", A, num_lookahead_tokens=lookahead)])
    assert m.stats().num_requests == 0
