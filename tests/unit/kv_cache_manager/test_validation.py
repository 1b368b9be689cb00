"""Every malformed input raises the right error and changes nothing (stats, tables, queue, cache)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest

from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationSpec
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KVMeshError, NotFound
from shared.hashing import BlockHash

from .helpers import hashes_of, make_manager, new, running, seq, snapshot

MAX_LEN = 128
LIVE = ("a", "b")


def setup_manager() -> KVCacheManager:
    """Two live requests: ``a`` (prefill done, 20 tokens) and ``b`` (chunked: 16 of 40 computed)."""
    m = make_manager(max_model_len=MAX_LEN)
    m.step((), [new("a", seq(0, 20)), new("b", seq(100, 40), num_new=16)])
    return m


Case = Callable[[KVCacheManager], object]


def with_hashes(spec: AllocationSpec, hashes: Sequence[bytes]) -> AllocationSpec:
    """``spec`` sent with other block hashes than the scheduler's."""
    return dataclasses.replace(spec, block_hashes=tuple(BlockHash(h) for h in hashes))


CASES: list[tuple[str, Case, type[KVMeshError]]] = [
    ("free unknown id", lambda m: m.free(["a", "nope"]), NotFound),
    ("free duplicate id", lambda m: m.free(["a", "a"]), InvalidArgument),
    ("step frees unknown id", lambda m: m.step(["nope"], [new("c", seq(0, 4))]), NotFound),
    ("step frees duplicate id", lambda m: m.step(["b", "b"], []), InvalidArgument),
    ("rollback of an unknown id", lambda m: m.free([], ["nope"]), NotFound),
    ("an id both freed and rolled back", lambda m: m.step(["a"], [], ["a"]), InvalidArgument),
    ("a step rolls back an unknown id", lambda m: m.step([], [new("c", seq(0, 4))], ["nope"]), NotFound),
    ("running allocation of unknown id", lambda m: m.step((), [running("nope", [1], 1)]), NotFound),
    ("running allocation of an id freed in the same step",
     lambda m: m.step(["a"], [running("a", [1], 1)]), NotFound),
    ("new allocation of a live id", lambda m: m.step((), [new("a", seq(0, 4))]), AlreadyExists),
    ("duplicate id within one step",
     lambda m: m.step((), [new("c", seq(0, 4)), new("c", seq(0, 4))]), InvalidArgument),
    ("duplicate running id within one step",
     lambda m: m.step((), [running("a", [1], 1), running("a", [2], 1)]), InvalidArgument),
    ("negative num_new_tokens (new)", lambda m: m.step((), [new("c", seq(0, 4), num_new=-1)]), InvalidArgument),
    ("negative num_new_tokens (running)", lambda m: m.step((), [running("a", [1], -1)]), InvalidArgument),
    ("negative num_external_blocks",
     lambda m: m.step((), [new("c", seq(0, 40), num_external_blocks=-1)]), InvalidArgument),
    ("empty request id", lambda m: m.step((), [new("", seq(0, 4))]), InvalidArgument),
    ("new request without tokens", lambda m: m.step((), [new("c", [])]), InvalidArgument),
    ("new prompt beyond max_model_len", lambda m: m.step((), [new("c", seq(0, MAX_LEN + 1))]), InvalidArgument),
    ("decode beyond max_model_len",
     lambda m: m.step((), [running("a", seq(500, MAX_LEN - 19), 1)]), InvalidArgument),
    ("negative token id", lambda m: m.step((), [new("c", [1, -2, 3])]), InvalidArgument),
    ("token id beyond int32", lambda m: m.step((), [new("c", [1, 2**31])]), InvalidArgument),
    ("negative token id in a decode", lambda m: m.step((), [running("a", [-1], 1)]), InvalidArgument),
    ("scheduling more tokens than known",
     lambda m: m.step((), [running("a", [7], 2)]), InvalidArgument),
    ("scheduling past a chunked prompt's known tokens",
     lambda m: m.step((), [running("b", [], 25)]), InvalidArgument),
    ("a valid allocation then a bad one in the same step",
     lambda m: m.step(["a"], [new("c", seq(0, 40)), running("b", [], 24), running("nope", [1], 1)]), NotFound),
    ("a valid free then a bad allocation", lambda m: m.step(["a"], [new("b", seq(0, 4))]), AlreadyExists),
    ("a block hash of the wrong length",
     lambda m: m.step((), [with_hashes(new("c", seq(0, 40)), [b"x" * 31, hashes_of(seq(0, 40))[1]])]),
     InvalidArgument),
    ("more hashes than full blocks (new)",
     lambda m: m.step((), [with_hashes(new("c", seq(0, 40)), [*hashes_of(seq(0, 48))])]), InvalidArgument),
    ("fewer hashes than the blocks a new request's step completes",
     lambda m: m.step((), [with_hashes(new("c", seq(0, 40)), hashes_of(seq(0, 40))[:1])]), InvalidArgument),
    ("more hashes than full blocks (decode)",
     lambda m: m.step((), [with_hashes(running("a", [7], 1), [b"h" * 32])]), InvalidArgument),
    ("fewer hashes than the blocks a running request's step completes",
     lambda m: m.step((), [with_hashes(running("a", seq(500, 12), 12), [])]), InvalidArgument),
    ("a valid allocation then one with a bad hash in the same step",
     lambda m: m.step(["a"], [new("c", seq(0, 40)), with_hashes(running("b", [], 24), [b""])]),
     InvalidArgument),
    ("lookup with a hash of the wrong length", lambda m: m.lookup_prefix([BlockHash(b"short")]), InvalidArgument),
    ("lookup beyond max_model_len",
     lambda m: m.lookup_prefix(hashes_of(seq(0, MAX_LEN + 16))), InvalidArgument),
    ("block table of an unknown id", lambda m: m.get_block_table("nope"), NotFound),
    ("reset while blocks are in use", lambda m: m.reset_prefix_cache(), FailedPrecondition),
]


@pytest.mark.parametrize(("case", "error"), [(c, e) for _, c, e in CASES], ids=[n for n, _, _ in CASES])
def test_bad_input_raises_and_changes_nothing(case: Case, error: type[KVMeshError]) -> None:
    m = setup_manager()
    before = snapshot(m, LIVE)
    with pytest.raises(error):
        case(m)
    assert snapshot(m, LIVE) == before
    m.check_integrity()


def test_the_valid_parts_of_a_rejected_step_still_work_alone() -> None:
    m = setup_manager()
    result = m.step(["a"], [new("c", seq(0, 40)), running("b", [], 24)])
    assert [r.new_block_ids for r in result.results] == [(1, 2, 4), (5, 6)]
    m.check_integrity()


def test_fields_only_read_for_new_requests_are_ignored_on_running_ones() -> None:
    m = setup_manager()
    spec = AllocationSpec("a", (1,), 1, use_prefix_cache=False, is_resumed=True, num_external_blocks=5)
    r = m.step((), [spec]).results[0]
    assert (r.new_block_ids, r.num_computed_tokens, r.num_new_tokens, r.external_block_ids) == ((), 20, 1, ())
    m.check_integrity()


def test_a_new_request_may_send_only_the_hashes_its_step_can_complete() -> None:
    m = setup_manager()
    h = hashes_of(seq(300, 40))
    # 15 tokens of the first chunk, plus at most the one block a hit could supply: one block full.
    r = m.step((), [with_hashes(new("c", seq(300, 40), num_new=15), h[:1])]).results[0]
    assert (r.new_block_ids, r.num_new_tokens) == ((4,), 15)
    assert m.get_block_table("c").block_hashes == ()
    # The next chunk brings the second hash with it (no tokens: the prompt is known).
    m.step((), [with_hashes(running("c", [], 25), h[1:])])
    assert m.get_block_table("c").block_hashes == tuple(h)
    m.check_integrity()
