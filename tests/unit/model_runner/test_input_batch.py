"""Batch input preparation: exact tensors for hand-worked layouts, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from services.model_runner.input_batch import PoolGeometry, ScheduledRequest, prepare_inputs
from shared.errors import InvalidArgument

GEOMETRY = PoolGeometry(num_blocks=16, block_size=4, vocab_size=100, max_model_len=64)
A_TOKENS = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # a prompt of 10
B_TOKENS = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # 9 computed, the 10th is the sampled token


def _req(rid: str = "a", tokens: list[int] | None = None, blocks: tuple[int, ...] = (3, 7, 8), computed: int = 0,
         new: int = 10) -> ScheduledRequest:  # fmt: skip
    return ScheduledRequest(rid, A_TOKENS if tokens is None else tokens, blocks, computed, new)


def test_prefill_chunk_plus_decode_block_size_4() -> None:
    # A: prefill chunk of positions 4..6 of 10 tokens (partial: samples nothing), blocks [3, 7, 8].
    # B: decode of position 9, blocks [2, 5, 9].
    a = ScheduledRequest("a", A_TOKENS, (3, 7, 8), num_computed_tokens=4, num_new_tokens=3)
    b = ScheduledRequest("b", B_TOKENS, (2, 5, 9), num_computed_tokens=9, num_new_tokens=1)
    batch = prepare_inputs([a, b], GEOMETRY)

    assert batch.input_ids.tolist() == [14, 15, 16, 59]
    assert batch.positions.tolist() == [4, 5, 6, 9]
    # pos 4,5,6 -> block 7 offsets 0,1,2 -> 28,29,30; pos 9 -> block 9 offset 1 -> 37.
    assert batch.meta.slot_mapping.tolist() == [28, 29, 30, 37]
    assert batch.meta.query_start_loc.tolist() == [0, 3, 4]
    assert batch.meta.seq_lens.tolist() == [7, 10]
    # Width = blocks needed by the longest context (10 tokens -> 3); A needs 2 of its 3 blocks.
    assert batch.meta.block_tables.tolist() == [[3, 7, 0], [2, 5, 9]]
    assert batch.logits_indices.tolist() == [3]
    assert batch.sampling_requests == (1,)
    assert (batch.meta.max_query_len, batch.meta.max_seq_len) == (3, 10)
    assert batch.input_ids.dtype == torch.int64 and batch.positions.dtype == torch.int64
    assert batch.meta.slot_mapping.dtype == torch.int64
    assert batch.meta.query_start_loc.dtype == torch.int32 and batch.meta.seq_lens.dtype == torch.int32
    assert batch.meta.block_tables.dtype == torch.int32


def test_last_chunk_samples_its_last_row() -> None:
    a = ScheduledRequest("a", A_TOKENS, (3, 7, 8), num_computed_tokens=7, num_new_tokens=3)
    b = ScheduledRequest("b", B_TOKENS, (2, 5, 9), num_computed_tokens=9, num_new_tokens=1)
    batch = prepare_inputs([a, b], GEOMETRY)
    assert batch.positions.tolist() == [7, 8, 9, 9]
    assert batch.meta.slot_mapping.tolist() == [31, 32, 33, 37]
    assert batch.logits_indices.tolist() == [2, 3]
    assert batch.sampling_requests == (0, 1)


def test_full_prefill_after_prefix_hit() -> None:
    # 8 tokens already cached in blocks 4, 6: only positions 8, 9 run; both land in block 11.
    req = ScheduledRequest("a", A_TOKENS, (4, 6, 11), num_computed_tokens=8, num_new_tokens=2)
    batch = prepare_inputs([req], GEOMETRY)
    assert batch.meta.slot_mapping.tolist() == [44, 45]
    assert batch.meta.block_tables.tolist() == [[4, 6, 11]]
    assert batch.logits_indices.tolist() == [1]


def test_extra_preallocated_blocks_are_not_in_the_table() -> None:
    req = ScheduledRequest("a", A_TOKENS[:3], (5, 6, 7), num_computed_tokens=0, num_new_tokens=3)
    assert prepare_inputs([req], GEOMETRY).meta.block_tables.tolist() == [[5]]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (_req(tokens=[*A_TOKENS[:9], 100]), "token id 100 is outside the vocabulary"),
        (_req(tokens=[-1, *A_TOKENS[1:]]), "token id -1"),
        (_req(blocks=(3, 16, 8)), "block id 16 is outside the pool"),
        (_req(blocks=(3, 0, 8)), "block id 0 is outside the pool"),
        (_req(blocks=(3, -2, 8)), "block id -2"),
        (_req(blocks=(3, 7)), "need 3 blocks"),
        (_req(blocks=tuple(range(1, 17))), "exceeds the 15 one sequence can use"),
        (_req(new=0), "num_new_tokens=0"),
        (_req(computed=-1, new=3), "num_computed_tokens=-1"),
        (_req(computed=8, new=3), "exceed its 10 tokens"),
        (_req(tokens=list(range(70)), blocks=tuple(range(1, 16)), new=70), "exceed max_model_len 64"),
    ],
)
def test_rejects(req: ScheduledRequest, message: str) -> None:
    ok = ScheduledRequest("ok", B_TOKENS, (2, 5, 9), 9, 1)
    with pytest.raises(InvalidArgument, match=message):
        prepare_inputs([ok, req], GEOMETRY)


@pytest.mark.parametrize(
    ("reqs", "message"),
    [
        # the first request in step order that breaks a rule is named, whichever rule a later one breaks
        ([_req("a", tokens=[*A_TOKENS[:9], 100]), _req("b", new=0)], "a: token id 100"),
        ([_req("a", blocks=(3, 16, 8)), _req("b", tokens=[-1, *A_TOKENS[1:]])], "a: block id 16"),
        ([_req("a", new=0), _req("b", blocks=(3, 0, 8))], "a: num_computed_tokens=0 .* num_new_tokens=0"),
        ([_req("a"), _req("b", blocks=(3, 0, 8)), _req("c", new=0)], "b: block id 0"),
        # within one request: its counts, then its table, then its tokens
        ([_req("a", tokens=[-1, *A_TOKENS[1:]], blocks=(3, 7))], "a: 10 tokens need 3 blocks"),
        ([_req("a", tokens=[-1, *A_TOKENS[1:]], blocks=(3, 0, 8))], "a: block id 0"),
    ],
)
def test_names_the_first_bad_request_in_step_order(reqs: list[ScheduledRequest], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        prepare_inputs(reqs, GEOMETRY)


def test_rejects_an_empty_step() -> None:
    with pytest.raises(InvalidArgument):
        prepare_inputs([], GEOMETRY)


def test_table_limit_is_the_smaller_of_pool_and_model_length() -> None:
    assert PoolGeometry(num_blocks=100, block_size=4, vocab_size=10, max_model_len=10).max_blocks_per_seq == 3
    assert PoolGeometry(num_blocks=3, block_size=4, vocab_size=10, max_model_len=64).max_blocks_per_seq == 2
