"""Batch inputs of a model with several KV cache groups: group-major tables, per-group slots, and
what a window group's table may hold before the window."""

from __future__ import annotations

import pytest

from services.model_runner.input_batch import PoolGeometry, ScheduledRequest, prepare_inputs
from shared.errors import InvalidArgument
from shared.kv_layout import dead_blocks

# group 0 full attention, group 1 a window of 6 tokens; blocks of 4
GEOMETRY = PoolGeometry(num_blocks=32, block_size=4, vocab_size=100, max_model_len=64, group_windows=(None, 6))
TOKENS = list(range(10, 30))  # 20 tokens


def test_each_group_gets_its_own_slots_and_tables_the_rest_is_shared() -> None:
    # 14 computed, 2 new (positions 14, 15): 4 blocks per group. The window group's first query
    # (position 14) sees keys 9..; block 0 (keys 0..3) and block 1 (4..7) lie wholly before it.
    req = ScheduledRequest("a", TOKENS, (1, 2, 3, 4, 0, 0, 9, 10), 14, 2)
    batch = prepare_inputs([req], GEOMETRY)
    full, window = batch.metas
    assert full.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3]  # block 4, offsets 2 and 3
    assert window.slot_mapping.tolist() == [10 * 4 + 2, 10 * 4 + 3]  # block 10
    assert full.block_tables.tolist() == [[1, 2, 3, 4]]
    assert window.block_tables.tolist() == [[0, 0, 9, 10]]
    assert (full.window, window.window) == (None, 6)
    assert full.query_start_loc is window.query_start_loc and full.seq_lens is window.seq_lens
    assert batch.meta is full and batch.positions.tolist() == [14, 15]


def test_dead_blocks_follow_transformers_window_rule() -> None:
    # a query at p sees keys p - window < j <= p
    assert dead_blocks(None, 4, 14) == 0
    assert dead_blocks(6, 4, 14) == 2  # first key 9: block 2
    assert dead_blocks(6, 4, 13) == 2  # first key 8: block 2
    assert dead_blocks(6, 4, 12) == 1  # first key 7: block 1
    assert dead_blocks(6, 4, 3) == 0


@pytest.mark.parametrize(
    ("blocks", "computed", "message"),
    [
        ((1, 2, 3, 4, 0, 5, 9, 10), 14, None),  # block 1 (keys 4..7) before the window: 0 is fine
        ((1, 2, 3, 4, 0, 0, 0, 10), 14, r"block id 0 \(KV cache group 1, block 2\) is outside the pool \[1, 32\)"),
        ((1, 2, 3, 4, 0, 0, 9, 10), 12, r"block id 0 \(KV cache group 1, block 1\)"),  # key 7 is in the window
        ((1, 0, 3, 4, 5, 6, 9, 10), 14, r"block id 0 \(KV cache group 0, block 1\)"),  # full group: never
        ((1, 2, 3, 4, 99, 0, 9, 10), 14, r"out of its window\) is outside the pool \[0, 32\)"),
        ((1, 2, 3, 4, 5, 6, 9), 14, "7 block ids do not split into 2 equal block tables"),
        ((1, 2, 3, 0, 0, 9), 14, "16 tokens need 4 blocks of 4, block table has 3"),
    ],
)
def test_window_tables_may_hold_anything_only_before_the_window(
    blocks: tuple[int, ...], computed: int, message: str | None
) -> None:
    req = ScheduledRequest("a", TOKENS, blocks, computed, 16 - computed)
    if message is None:
        assert prepare_inputs([req], GEOMETRY).metas[1].block_tables.tolist() == [list(blocks[4:])]
        return
    with pytest.raises(InvalidArgument, match=message):
        prepare_inputs([req], GEOMETRY)
