"""Random step sequences on models with window groups, against a model of what each block holds.

As test_state_machine.py, per KV cache group: the model tracks each live request's table per group
(the null block where a window slid past) and, per block, the (group, salt, prefix) last computed
into it. After every rule: integrity passes; the free count and every table equal the model's; a
window group frees exactly the blocks that died at the step's start; every hit block holds its
group's KV of the right prefix (never another group's, never garbage after a rollback); a hit is
the longest one the rule allows, by a brute-force search over the pool's maps; and the hashes
rebuilt from the events equal group 0's map.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
)
from shared.hashing import BlockHash
from shared.kv_layout import dead_blocks

from .helpers import hashes_of

BS = 4
NUM_BLOCKS = 17  # 16 usable
MAX_LEN = 48
FAMILIES = [[f * 1000 + i for i in range(MAX_LEN)] for f in range(3)]

Content = tuple[int, bytes, tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRequest:
    def __init__(self, tokens: list[int], salt: bytes, tables: list[list[int]]) -> None:
        self.tokens = tokens
        self.salt = salt
        self.tables = tables
        self.computed = 0
        self.pending: list[int] = []  # blocks the latest allocation was to fill


class GroupsMachine(RuleBasedStateMachine):
    windows: tuple[int | None, ...] = (None, 6)

    def __init__(self) -> None:
        super().__init__()
        self.hub = EventHub()
        self.sub = self.hub.subscribe()
        self.m = KVCacheManager(CacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=MAX_LEN,
                                            group_windows=self.windows), self.hub)
        self.g = len(self.windows)
        self.live: dict[str, ModelRequest] = {}
        self.content: dict[int, Content] = {}
        self.event_hashes: set[bytes] = set()
        self.salts: dict[str, bytes] = {}
        self.next_id = 0

    def held(self) -> set[int]:
        return {b for req in self.live.values() for t in req.tables for b in t if b}

    def model_free(self) -> int:
        return NUM_BLOCKS - 1 - len(self.held())

    def record_computed(self, req: ModelRequest, upto: int) -> None:
        for g, table in enumerate(req.tables):
            for i in range(min(upto // BS, len(req.tokens) // BS)):
                if table[i]:
                    self.content[table[i]] = (g, req.salt, tuple(req.tokens[: (i + 1) * BS]))

    def brute_force_hit(self, tokens: Sequence[int], hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """The rule, spelled out: the largest k whose every needed block is in its group's map."""
        def ok(g: int, i: int) -> bool:
            block = self.m.pool.maps[g].get(hashes[i])
            return block is not None and block.token_ids == tuple(tokens[i * BS : (i + 1) * BS])
        for k in range(min(max_blocks, len(hashes)), -1, -1):
            if all(ok(g, i) for g, w in enumerate(self.windows) for i in range(dead_blocks(w, BS, k * BS), k)):
                return k
        return 0

    def draw_new(self, data: st.DataObject) -> AllocationSpec:
        family = data.draw(st.integers(0, len(FAMILIES) - 1))
        shared = data.draw(st.integers(0, 40))
        tail = data.draw(st.lists(st.integers(0, 3), min_size=0 if shared else 1, max_size=MAX_LEN - shared))
        tokens = FAMILIES[family][:shared] + tail
        rid = f"r{self.next_id}"
        self.next_id += 1
        salt = self.salts[rid] = data.draw(st.sampled_from([b"", b"", b"salt"]))
        return AllocationSpec(rid, tuple(tokens), data.draw(st.integers(0, len(tokens) + 2)), is_new=True,
                              use_prefix_cache=data.draw(st.sampled_from([True, True, False])),
                              block_hashes=tuple(hashes_of(tokens, salt, BS)))

    def draw_running(self, data: st.DataObject, rid: str) -> AllocationSpec:
        req = self.live[rid]
        if req.computed < len(req.tokens):
            return AllocationSpec(rid, (), data.draw(st.integers(0, len(req.tokens) - req.computed)))
        new_tokens = data.draw(st.lists(st.integers(0, 3), max_size=min(3, MAX_LEN - len(req.tokens))))
        fresh = hashes_of([*req.tokens, *new_tokens], req.salt, BS)[len(req.tokens) // BS :]
        return AllocationSpec(rid, tuple(new_tokens), data.draw(st.integers(0, len(new_tokens))),
                              block_hashes=tuple(fresh))

    def apply(self, free_ids: list[str], specs: list[AllocationSpec]) -> None:
        expected_hits = {s.request_id: self.brute_force_hit(s.new_token_ids, s.block_hashes,
                                                            (len(s.new_token_ids) - 1) // BS)
                         for s in specs if s.is_new and s.use_prefix_cache}
        for rid in free_ids:
            del self.live[rid]
        result = self.m.step(free_ids, specs)
        for spec, res in zip(specs, result.results, strict=True):
            if spec.is_new:
                # Frees leave the maps as they were; an earlier allocation of the step may not.
                self.check_new(spec, res, self.salts[spec.request_id], expected_hits.get(spec.request_id),
                               spec is specs[0])
            else:
                self.check_running(spec, res)

    def check_new(self, spec: AllocationSpec, res: AllocationResult, salt: bytes, expected: int | None,
                  exact: bool) -> None:
        if res.status is AllocationStatus.OUT_OF_BLOCKS:
            return
        tokens = list(spec.new_token_ids)
        hits = res.num_cached_tokens // BS
        if expected is None:
            assert hits == 0
        elif exact:
            assert hits == expected, "not the longest hit the rule allows"
        ids = list(res.new_block_ids)
        n = cdiv(res.num_computed_tokens + res.num_new_tokens, BS)
        assert len(ids) == n * self.g and res.num_computed_tokens == hits * BS
        tables = [ids[g * n : (g + 1) * n] for g in range(self.g)]
        held = self.held()
        for g, (w, table) in enumerate(zip(self.windows, tables, strict=True)):
            skip = dead_blocks(w, BS, hits * BS)
            assert table[:skip] == [0] * skip
            for i in range(skip, hits):
                assert self.content.get(table[i]) == (g, salt, tuple(tokens[: (i + 1) * BS])), "wrong KV served"
            assert all(b and b not in held for b in table[hits:]), "a fresh block was in use"
            for b in table[hits:]:
                self.content.pop(b, None)
        req = ModelRequest(tokens, salt, tables)
        req.pending = [b for t in tables for b in t[hits:]]
        req.computed = res.num_computed_tokens + res.num_new_tokens
        self.live[spec.request_id] = req
        self.record_computed(req, req.computed)

    def check_running(self, spec: AllocationSpec, res: AllocationResult) -> None:
        req = self.live[spec.request_id]
        total = req.computed + spec.num_new_tokens
        need = max(0, cdiv(total, BS) - len(req.tables[0]))
        dead = [(g, i) for g, w in enumerate(self.windows)
                for i in range(dead_blocks(w, BS, req.computed)) if req.tables[g][i]]
        others = {b for rid, r in self.live.items() if rid != spec.request_id for t in r.tables for b in t if b}
        freed = sum(1 for g, i in dead if req.tables[g][i] not in others)
        if res.status is AllocationStatus.OUT_OF_BLOCKS:
            assert need * self.g > self.model_free() + freed
            return
        for g, i in dead:
            req.tables[g][i] = 0
        new = list(res.new_block_ids)
        assert len(new) == need * self.g
        assert not set(new) & self.held()
        for b in new:
            self.content.pop(b, None)
        start = req.computed // BS
        for g, table in enumerate(req.tables):
            table.extend(new[g * need : (g + 1) * need])
        req.tokens.extend(spec.new_token_ids)
        req.pending = [b for t in req.tables for b in t[start:] if b]
        req.computed = total
        self.record_computed(req, total)

    @rule(data=st.data())
    def allocate_new(self, data: st.DataObject) -> None:
        """One new request alone; the read-only lookup (by hash) applies the same rule first."""
        spec = self.draw_new(data)
        max_blocks = (len(spec.new_token_ids) - 1) // BS
        before = self.m.stats()
        lookup = self.m.lookup_prefix(spec.block_hashes[:max_blocks])
        assert self.m.stats() == before
        k = self.brute_force_hit(spec.new_token_ids, spec.block_hashes, max_blocks)
        assert lookup.num_cached_tokens == k * BS
        assert len(lookup.block_ids) == k * self.g
        self.apply([], [spec])

    @rule(data=st.data())
    def mixed_step(self, data: st.DataObject) -> None:
        live = sorted(self.live)
        free_ids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)) if live else []
        remaining = [rid for rid in live if rid not in free_ids]
        cont = data.draw(st.lists(st.sampled_from(remaining), unique=True, max_size=3)) if remaining else []
        specs = [self.draw_running(data, rid) for rid in cont]
        specs += [self.draw_new(data) for _ in range(data.draw(st.integers(0, 2)))]
        self.apply(free_ids, specs)

    @rule(data=st.data())
    def advance_all(self, data: st.DataObject) -> None:
        self.apply([], [self.draw_running(data, rid) for rid in sorted(self.live)])

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        if not self.live:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        self.m.free([], ids)
        for rid in ids:
            for b in self.live.pop(rid).pending:
                self.content.pop(b, None)

    @invariant()
    def consistent(self) -> None:
        self.m.check_integrity()
        assert self.m.stats().num_free_blocks == self.model_free()
        for rid, req in self.live.items():
            assert list(self.m.get_block_table(rid).block_ids) == [b for t in req.tables for b in t]
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


class WindowOnlyMachine(GroupsMachine):
    windows = (5,)


class TwoWindowsMachine(GroupsMachine):
    windows = (None, 4, 9)


_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHybrid = GroupsMachine.TestCase
TestHybrid.settings = _SETTINGS
TestWindowOnly = WindowOnlyMachine.TestCase
TestWindowOnly.settings = _SETTINGS
TestTwoWindows = TwoWindowsMachine.TestCase
TestTwoWindows.settings = _SETTINGS
