"""Random step sequences against a model of what each block physically holds.

The model tracks, per live request, its tokens, computed count and block ids, and per block the
prefix (salt, tokens up to the block's end) last computed into it. After every rule: the
manager's integrity check passes; its free count equals the model's; every prefix hit points at
blocks that really hold that prefix (the cache never serves wrong KV); and the set of cached
hashes rebuilt from the KV events equals the pool's.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
)
from shared.errors import FailedPrecondition

from .helpers import hashes_of, make_manager, snapshot

BS = 4
NUM_BLOCKS = 13  # 12 usable
MAX_LEN = 48
FAMILIES = [[f * 1000 + i for i in range(MAX_LEN)] for f in range(3)]

Content = tuple[bytes, tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRequest:
    """What the test expects the manager to know about one live request."""

    def __init__(self, tokens: list[int], salt: bytes) -> None:
        self.tokens = tokens
        self.salt = salt
        self.computed = 0
        self.blocks: list[int] = []
        # Blocks the latest successful allocation was to fill: garbage if it is rolled back.
        self.pending: list[int] = []


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.hub = EventHub()
        self.sub = self.hub.subscribe()
        self.m = make_manager(num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=MAX_LEN, hub=self.hub)
        self.live: dict[str, ModelRequest] = {}
        self.content: dict[int, Content] = {}
        self.event_hashes: set[bytes] = set()
        self.salts: dict[str, bytes] = {}  # request id -> the salt its hashes were made with
        self.next_id = 0

    # ------------------------------------------------------------------ model helpers

    def held(self) -> set[int]:
        return {b for req in self.live.values() for b in req.blocks}

    def model_free(self) -> int:
        return NUM_BLOCKS - 1 - len(self.held())

    def record_computed(self, req: ModelRequest, upto_tokens: int) -> None:
        """Blocks of ``req`` fully computed by ``upto_tokens`` now hold their prefix."""
        for i in range(min(upto_tokens // BS, len(req.tokens) // BS)):
            self.content[req.blocks[i]] = (req.salt, tuple(req.tokens[: (i + 1) * BS]))

    def check_hits(self, tokens: Sequence[int], salt: bytes, block_ids: Sequence[int]) -> None:
        for i, block_id in enumerate(block_ids):
            assert self.content.get(block_id) == (salt, tuple(tokens[: (i + 1) * BS])), "wrong KV served"

    def draw_new_spec(self, data: st.DataObject) -> AllocationSpec:
        family = data.draw(st.integers(0, len(FAMILIES) - 1))
        shared = data.draw(st.integers(0, 32))
        tail = data.draw(st.lists(st.integers(0, 3), min_size=0 if shared else 1, max_size=MAX_LEN - shared))
        tokens = FAMILIES[family][:shared] + tail
        rid = f"r{self.next_id}"
        self.next_id += 1
        salt = self.salts[rid] = data.draw(st.sampled_from([b"", b"", b"salt"]))
        return AllocationSpec(
            rid, tuple(tokens), data.draw(st.integers(0, len(tokens) + 2)), is_new=True,
            use_prefix_cache=data.draw(st.sampled_from([True, True, False])),
            is_resumed=data.draw(st.booleans()),
            num_external_blocks=data.draw(st.sampled_from([0, 0, 1, 3])),
            block_hashes=tuple(hashes_of(tokens, salt, BS)),
        )

    def draw_running_spec(self, data: st.DataObject, rid: str) -> AllocationSpec:
        req = self.live[rid]
        if req.computed < len(req.tokens):  # next prefill chunk
            return AllocationSpec(rid, (), data.draw(st.integers(0, len(req.tokens) - req.computed)))
        room = MAX_LEN - len(req.tokens)
        new_tokens = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=min(3, room)))
        fresh = hashes_of([*req.tokens, *new_tokens], req.salt, BS)[len(req.tokens) // BS :]
        return AllocationSpec(rid, tuple(new_tokens), data.draw(st.integers(0, len(new_tokens))),
                              block_hashes=tuple(fresh))

    # ------------------------------------------------------------------ applying a step

    def apply(self, free_ids: list[str], specs: list[AllocationSpec]) -> list[AllocationResult]:
        result = self.m.step(free_ids, specs)
        for rid in free_ids:
            del self.live[rid]
        for spec, res in zip(specs, result.results, strict=True):
            assert res.request_id == spec.request_id
            if spec.is_new:
                self.check_new(spec, res)
            else:
                self.check_running(spec, res)
        return list(result.results)

    def check_new(self, spec: AllocationSpec, res: AllocationResult) -> None:
        tokens = list(spec.new_token_ids)
        if res.status is AllocationStatus.OUT_OF_BLOCKS:
            assert res == AllocationResult(spec.request_id, AllocationStatus.OUT_OF_BLOCKS)
            return
        hits = res.num_cached_tokens // BS
        max_cached = (len(tokens) - 1) // BS
        assert res.num_cached_tokens % BS == 0 and hits <= max_cached
        assert spec.use_prefix_cache or hits == 0
        known = max(hits, min(spec.num_external_blocks, max_cached))
        assert res.num_computed_tokens == known * BS
        assert res.num_new_tokens == min(spec.num_new_tokens, len(tokens) - known * BS)
        ids = list(res.new_block_ids)
        assert len(ids) == cdiv(res.num_computed_tokens + res.num_new_tokens, BS)
        assert list(res.external_block_ids) == ids[hits:known]
        salt = self.salts[spec.request_id]
        self.check_hits(tokens, salt, ids[:hits])
        fresh = ids[hits:]
        assert not set(fresh) & self.held(), "a fresh block was still in use"
        for block_id in fresh:
            self.content.pop(block_id, None)
        req = ModelRequest(tokens, salt)
        req.blocks = ids
        req.pending = fresh  # external blocks too: a rolled-back request never loads them
        req.computed = res.num_computed_tokens + res.num_new_tokens
        self.live[spec.request_id] = req
        self.record_computed(req, req.computed)

    def check_running(self, spec: AllocationSpec, res: AllocationResult) -> None:
        req = self.live[spec.request_id]
        total = req.computed + spec.num_new_tokens
        need = cdiv(total, BS) - len(req.blocks)
        if res.status is AllocationStatus.OUT_OF_BLOCKS:
            assert need > self.model_free()
            return
        assert res.num_computed_tokens == req.computed
        assert res.num_new_tokens == spec.num_new_tokens
        assert len(res.new_block_ids) == max(0, need)
        assert not set(res.new_block_ids) & self.held()
        for block_id in res.new_block_ids:
            self.content.pop(block_id, None)
        req.tokens.extend(spec.new_token_ids)
        req.blocks.extend(res.new_block_ids)
        req.pending = req.blocks[req.computed // BS :]
        req.computed = total
        self.record_computed(req, total)

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def allocate_new(self, data: st.DataObject) -> None:
        """One new request alone: its hit must be exactly what a lookup just reported."""
        spec = self.draw_new_spec(data)
        lookup = self.m.lookup_prefix(spec.block_hashes[: (len(spec.new_token_ids) - 1) // BS])
        self.check_hits(spec.new_token_ids, self.salts[spec.request_id], lookup.block_ids)
        (res,) = self.apply([], [spec])
        if res.status is AllocationStatus.OK:
            expected = lookup.num_cached_tokens if spec.use_prefix_cache else 0
            assert res.num_cached_tokens == expected
        else:
            hit_blocks = lookup.block_ids if spec.use_prefix_cache else ()
            known = max(len(hit_blocks), min(spec.num_external_blocks, (len(spec.new_token_ids) - 1) // BS))
            num_new = min(spec.num_new_tokens, len(spec.new_token_ids) - known * BS)
            fresh = cdiv(known * BS + num_new, BS) - len(hit_blocks)
            free_hits = len(set(hit_blocks) - self.held())
            assert fresh > self.model_free() - free_hits

    @rule(data=st.data())
    def mixed_step(self, data: st.DataObject) -> None:
        """Frees, continues some running requests and admits new ones, in one step."""
        live = sorted(self.live)
        free_ids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)) if live else []
        remaining = [rid for rid in live if rid not in free_ids]
        cont = data.draw(st.lists(st.sampled_from(remaining), unique=True, max_size=3)) if remaining else []
        specs = [self.draw_running_spec(data, rid) for rid in cont]
        specs += [self.draw_new_spec(data) for _ in range(data.draw(st.integers(0, 2)))]
        self.apply(free_ids, specs)

    @rule(data=st.data())
    def advance_all(self, data: st.DataObject) -> None:
        """A step of running requests only: prefill chunks and decodes."""
        self.apply([], [self.draw_running_spec(data, rid) for rid in sorted(self.live)])

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.live:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        self.m.free(ids)
        for rid in ids:
            del self.live[rid]

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """Requests released as if their latest allocation never ran: what it was to fill is
        garbage, so no later hit may serve it (``check_hits`` would see the missing content)."""
        if not self.live:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        self.m.free([], ids)
        for rid in ids:
            for block_id in self.live.pop(rid).pending:
                self.content.pop(block_id, None)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        family = data.draw(st.integers(0, len(FAMILIES) - 1))
        tokens = FAMILIES[family][: data.draw(st.integers(0, MAX_LEN))]
        salt = data.draw(st.sampled_from([b"", b"salt"]))
        before = snapshot(self.m, sorted(self.live))
        result = self.m.lookup_prefix(hashes_of(tokens, salt, BS)[: max(0, (len(tokens) - 1) // BS)])
        assert snapshot(self.m, sorted(self.live)) == before
        self.check_hits(tokens, salt, result.block_ids)
        assert result.num_cached_tokens == len(result.block_ids) * BS

    @rule()
    def reset(self) -> None:
        if self.held():  # refused while any block is in use (a live request may hold none)
            with pytest.raises(FailedPrecondition):
                self.m.reset_prefix_cache()
        else:
            self.m.reset_prefix_cache()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self) -> None:
        self.m.check_integrity()
        stats = self.m.stats()
        assert stats.num_free_blocks == self.model_free()
        assert stats.num_requests == len(self.live)
        for rid, req in self.live.items():
            table = self.m.get_block_table(rid)
            assert list(table.block_ids) == req.blocks
            assert table.num_tokens == len(req.tokens)
        while (batch := self.sub.get(timeout=0)) is not None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert not self.event_hashes & set(event.block_hashes)
                    self.event_hashes |= set(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= self.event_hashes
                    self.event_hashes -= set(event.block_hashes)
                else:
                    assert isinstance(event, AllBlocksCleared)
                    self.event_hashes.clear()
        assert self.event_hashes == set(self.m.pool.cached)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
