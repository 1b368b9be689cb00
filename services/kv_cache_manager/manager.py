"""KVCacheManager: block tables, prefix-cache hits and slot allocation for scheduler steps.

One step = frees, then allocations in order. Each allocation either succeeds or reports
OUT_OF_BLOCKS having changed nothing; malformed input raises before anything changes. Not
thread-safe: the servicer serialises calls with one lock.

The manager never hashes: the scheduler owns the hash seed and sends each request's full-block
hashes with its allocations (docs/design.md, "Block hashes"); a hit is verified by the block's
stored token ids, so a colliding hash is a miss, never another prompt's KV.

KV cache groups (shared/kv_layout.py): a model whose layers attend alike has one group and one
table per request. A model with sliding-window layers has one table per group, all drawn from the
one pool and all of one length; block ids leave group-major (group 0's table, then group 1's, ...,
and a running request's new ids as one equal run per group). At each step a window group's blocks
that slid out of every future query's window go back to the pool; the prefix hit needs every full
group's leading blocks and every window group's last window of them (prefix_hit.py).

A new request's table, with a pool hit on two blocks and an external (offload-store) hit on one::

    prompt:  [ 16 tok ][ 16 tok ][ 16 tok ][ 16 tok ][ 7 tok  ]
    blocks:  [  hit   ][  hit   ][external][ fresh  ][ fresh  ]
             |   <- cached ->   |  (num_cached_tokens)
             | <- num_computed_tokens ->  | <-num_new_tokens->|
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_cache_manager.block_pool import BlockPool, KVCacheBlock
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.integrity import check_integrity
from services.kv_cache_manager.prefix_hit import find_longest_hit
from services.kv_cache_manager.request import RequestState
from services.kv_cache_manager.types import (
    AllBlocksCleared,
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    BlockRemoved,
    BlockStored,
    BlockTable,
    EvictedBlock,
    KVCacheStats,
    KVEvent,
    PrefixLookup,
    StepResult,
)
from services.kv_cache_manager.validation import validate_free, validate_hashes, validate_step
from shared.errors import FailedPrecondition, InvalidArgument, NotFound
from shared.hashing import BlockHash
from shared.kv_layout import dead_range

_OK = AllocationStatus.OK


class KVCacheManager:
    """The kv-cache-manager core.

    Args:
        config: pool geometry.
        events: where KV events go; they are only built while it has subscribers.
    """

    def __init__(self, config: CacheConfig, events: EventHub | None = None) -> None:
        self._hub = events
        self._reset(config)

    def _reset(self, config: CacheConfig) -> None:
        self._config = config
        self._block_size = config.block_size
        self._windows = config.group_windows
        self._num_groups = len(config.group_windows)
        # (group, window) of every window group: the only ones that free blocks as they go.
        self._window_groups = [(g, w) for g, w in enumerate(config.group_windows) if w is not None]
        # Per group its attention-sink tokens (StreamingLLM): its dead blocks are a middle range.
        self._sinks = tuple(config.sink_tokens(g) for g in range(self._num_groups))
        self._pool = BlockPool(config.num_blocks, self._num_groups)
        self._requests: dict[str, RequestState] = {}
        self._prefix_queries = self._prefix_hits = 0
        self._recompute_queries = self._recompute_hits = 0

    @property
    def config(self) -> CacheConfig:
        """The current pool geometry."""
        return self._config

    @property
    def pool(self) -> BlockPool:
        """The block pool, for inspection (tests, integrity); mutate it only through the manager."""
        return self._pool

    def initialize(self, config: CacheConfig, keep_cache: bool = False) -> tuple[KVCacheStats, bool, int]:
        """Rebinds the pool to ``config``: every live request is freed first.

        Called when the owning scheduler (re)binds: at its start, after it took over from a dead
        predecessor, or when it found a new runner incarnation. None of the live requests can go
        on (their scheduler forgot them), so all are released *with a rollback*: their latest
        allocation may never have run, and a block registered for KV nobody computed must not stay
        cached. The cache survives only when ``keep_cache`` (same runner pool incarnation) and the
        geometry (and model id) are unchanged; otherwise the pool is recreated and counters restart.
        (A scheduler with another hash seed simply never hits the old blocks; LRU reuses them.)

        Returns:
            The stats afterwards, whether the cache was kept, and how many requests were freed.
        """
        events = self._begin_events()
        num_freed = len(self._requests)
        kept = keep_cache and config == self._config
        if kept:
            self._free_all([], list(self._requests), events)
        else:
            self._reset(config)
            if events is not None:
                events.append(AllBlocksCleared())
        self._publish(events)
        return self.stats(), kept, num_freed

    # ------------------------------------------------------------------ steps

    def step(self, free_request_ids: Sequence[str] = (),
             allocations: Sequence[AllocationSpec] = (),
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        """Frees ``free_request_ids`` and ``rollback_request_ids``, then applies ``allocations`` in order.

        Args:
            free_request_ids: live requests to release first (finished, aborted, preempted).
            allocations: this step's scheduled requests.
            rollback_request_ids: live requests to release whose latest allocation never ran
                (see :meth:`free`).

        Returns:
            One result per allocation, the cached blocks evicted to make room (in eviction
            order) and the stats after the step.

        Raises:
            InvalidArgument, NotFound, AlreadyExists: malformed step; nothing changed.
        """
        validate_step(self._requests, [*free_request_ids, *rollback_request_ids], allocations,
                      self._config.max_model_len, self._block_size, self._config.has_windows)
        events = self._begin_events()
        self._free_all(free_request_ids, rollback_request_ids, events)
        evicted: list[EvictedBlock] = []
        results = tuple(self._allocate(spec, evicted, events) for spec in allocations)
        self._publish(events)
        return StepResult(results, tuple(evicted), self.stats())

    def allocate_slots(self, allocations: Sequence[AllocationSpec]) -> StepResult:
        """A step with allocations only."""
        return self.step((), allocations)

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        """Releases every block of the given live requests, each table tail first.

        Args:
            request_ids: requests whose every allocation ran (finished, aborted or preempted
                between steps): their registered blocks stay cached.
            rollback_request_ids: requests whose latest allocation never ran — preempted or
                refused in the very step that allocated them, or caught in a failed step. Blocks
                are registered when they are *allocated* (so a request admitted later in the
                same step can share them), which means that allocation's blocks do not hold
                their tokens' KV; they are unregistered before being freed, or a later hit on
                them would read garbage.

        Raises:
            NotFound, InvalidArgument: an id is not live or named twice; nothing changed.
        """
        validate_free(self._requests, [*request_ids, *rollback_request_ids])
        events = self._begin_events()
        self._free_all(request_ids, rollback_request_ids, events)
        self._publish(events)
        return self.stats()

    def _free_all(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str],
                  events: list[KVEvent] | None) -> None:
        for request_id in request_ids:
            self._free_one(request_id)
        removed: list[BlockHash] = []
        uncache = self._pool.uncache_block
        for request_id in rollback_request_ids:
            state = self._requests[request_id]
            for g, table in enumerate(state.tables):
                for block in table[state.num_committed_blocks : state.num_cached_blocks]:
                    block_hash = uncache(block)  # None for the null block (it is never hashed)
                    if block_hash is not None and g == 0:
                        removed.append(block_hash)
            self._free_one(request_id)
        if events is not None and removed:
            events.append(BlockRemoved(tuple(removed)))

    def _free_one(self, request_id: str) -> None:
        state = self._requests.pop(request_id)
        # NOTE: tail first, so a chain's tail lands in the free queue before its head and is
        # evicted first: a later request is likelier to share a prefix's head than its tail. With
        # several groups, position by position from the tail (every group's block of a position
        # together), so no group's head is evicted before another group's tail.
        if self._num_groups == 1 and not self._window_groups:
            self._pool.free_blocks(reversed(state.blocks))
            return
        null = self._pool.null_block
        tables = state.tables
        self._pool.free_blocks([t[i] for i in range(len(state.blocks) - 1, -1, -1) for t in tables
                                if t[i] is not null])

    def _allocate(self, spec: AllocationSpec, evicted: list[EvictedBlock],
                  events: list[KVEvent] | None) -> AllocationResult:
        if spec.is_new:
            return self._allocate_new(spec, evicted, events)
        return self._allocate_running(spec, self._requests[spec.request_id], evicted, events)

    def _allocate_new(self, spec: AllocationSpec, evicted: list[EvictedBlock],
                      events: list[KVEvent] | None) -> AllocationResult:
        """Registers a request: prefix hit, external blocks, then slots for its first chunk.

        NOTE: ``use_prefix_cache=False`` only skips *reading* the cache (and its stats); the
        request's computed blocks are still registered, so later requests can reuse them.
        """
        bs = self._block_size
        pool = self._pool
        num_groups = self._num_groups
        tokens = list(spec.new_token_ids)
        num_tokens = len(tokens)
        hashes = list(spec.block_hashes)
        # NOTE: the last token is always computed (its logits are needed), so at most
        # (num_tokens - 1) // block_size full blocks can come from any cache tier.
        max_cached_blocks = (num_tokens - 1) // bs
        if spec.use_prefix_cache:
            num_hit, hit_tables = self._find_hit(hashes, tokens, max_cached_blocks)
        else:
            num_hit, hit_tables = 0, [[] for _ in range(num_groups)]
        # External (offload-store) blocks exist for single-group all-full models only (validated).
        num_known = max(num_hit, min(spec.num_external_blocks, max_cached_blocks))
        num_computed = num_known * bs
        num_new = min(spec.num_new_tokens, num_tokens - num_computed)
        num_fresh = -(-(num_computed + num_new) // bs) - num_hit  # per group
        # Taking a free cached hit removes it from the free queue, so it cannot also be fresh.
        null = pool.null_block
        hit_blocks = [block for table in hit_tables for block in table if block is not null]
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_fresh * num_groups > pool.num_free_blocks - num_free_hits:
            return AllocationResult(spec.request_id, AllocationStatus.OUT_OF_BLOCKS)
        end = num_computed + num_new
        num_fresh += self._lookahead_blocks(end, num_hit + num_fresh, spec.num_lookahead_tokens,
                                            pool.num_free_blocks - num_free_hits - num_fresh * num_groups)

        pool.touch(hit_blocks)
        fresh = self._get_new_blocks(num_fresh * num_groups, evicted, events)
        tables = [hit_tables[g] + fresh[g * num_fresh : (g + 1) * num_fresh] for g in range(num_groups)]
        state = RequestState(spec.request_id, num_tokens, tokens[num_hit * bs :], hashes, num_hit, tables)
        for g, window in self._window_groups:
            state.num_skipped[g] = dead_range(window, self._sinks[g], bs, num_hit * bs)[1]
        state.num_computed_tokens = num_computed + num_new
        state.reserved_end = end + spec.num_lookahead_tokens
        self._requests[spec.request_id] = state
        self._cache_full_blocks(state, (num_computed + num_new) // bs, events)
        if spec.use_prefix_cache:
            if spec.is_resumed:
                self._recompute_queries += num_tokens
                self._recompute_hits += num_hit * bs
            else:
                self._prefix_queries += num_tokens
                self._prefix_hits += num_hit * bs
        return AllocationResult(
            spec.request_id, _OK,
            new_block_ids=tuple([block.block_id for table in tables for block in table]),
            num_computed_tokens=num_computed,
            num_new_tokens=num_new,
            num_cached_tokens=num_hit * bs,
            external_block_ids=tuple([block.block_id for block in fresh[: num_known - num_hit]]),
        )

    def _allocate_running(self, spec: AllocationSpec, state: RequestState, evicted: list[EvictedBlock],
                          events: list[KVEvent] | None) -> AllocationResult:
        """Frees the window groups' blocks that slid out of the window, then slots for the new tokens.

        The step starts at ``num_computed_tokens``: a window group's blocks all of whose tokens lie
        before its first query's window are dead (shared/kv_layout.py's ``dead_blocks``). They count
        as free for the capacity check (those no other request holds), and are freed only once the
        allocation fits, so a refused allocation still changes nothing.
        """
        bs = self._block_size
        num_groups = self._num_groups
        num_computed = state.num_computed_tokens
        total = num_computed + spec.num_new_tokens
        num_fresh = max(0, -(-total // bs) - len(state.blocks))  # per group
        dead = state.dead_blocks(self._window_groups, bs, num_computed, self._sinks) if self._window_groups else []
        num_freed = sum(1 for block in dead if block.ref_cnt == 1)
        if num_fresh * num_groups > self._pool.num_free_blocks + num_freed:
            return AllocationResult(spec.request_id, AllocationStatus.OUT_OF_BLOCKS)
        num_fresh += self._lookahead_blocks(total, len(state.blocks) + num_fresh, spec.num_lookahead_tokens,
                                            self._pool.num_free_blocks + num_freed - num_fresh * num_groups)
        if dead:
            state.skip_dead(self._window_groups, bs, num_computed, self._pool.null_block, self._sinks)
            self._pool.free_blocks(dead)
        state.append(spec.new_token_ids, spec.block_hashes)
        fresh = self._get_new_blocks(num_fresh * num_groups, evicted, events) if num_fresh else []
        for g, table in enumerate(state.tables):
            table.extend(fresh[g * num_fresh : (g + 1) * num_fresh])
        state.num_computed_tokens = total
        state.reserved_end = max(state.reserved_end, total + spec.num_lookahead_tokens)
        state.num_committed_blocks = state.num_cached_blocks  # the previous step ran
        self._cache_full_blocks(state, total // bs, events)
        return AllocationResult(
            spec.request_id, _OK,
            new_block_ids=tuple([block.block_id for block in fresh]),
            num_computed_tokens=num_computed,
            num_new_tokens=spec.num_new_tokens,
        )

    def _lookahead_blocks(self, end: int, num_blocks: int, lookahead: int, num_free: int) -> int:
        """Blocks per group to add to a table of ``num_blocks`` for ``lookahead`` slots past ``end``
        (async scheduling's reserve, best effort): only as many as leave every live request one more
        block per group among the ``num_free`` free blocks left after the step's own.

        NOTE: the reserve never costs a refusal or a preemption: under pressure it shrinks to nothing
        and the scheduler's next step allocates synchronously, as without async scheduling.
        """
        if lookahead <= 0:
            return 0
        want = -(-min(end + lookahead, self._config.max_model_len) // self._block_size) - num_blocks
        spare = (num_free - len(self._requests) * self._num_groups) // self._num_groups
        return max(0, min(want, spare))

    def _find_hit(self, hashes: Sequence[BlockHash], token_ids: Sequence[int] | None,
                  max_blocks: int) -> tuple[int, list[list[KVCacheBlock]]]:
        """The longest hit over every group and its per-group tables (see prefix_hit.py)."""
        if self._num_groups == 1 and not self._window_groups:
            hits = self.get_computed_blocks(hashes, token_ids, max_blocks)
            return len(hits), [hits]
        return find_longest_hit(self._pool, self._windows, hashes, token_ids, max_blocks, self._block_size,
                                self._sinks)

    def get_computed_blocks(self, hashes: Sequence[BlockHash], token_ids: Sequence[int] | None,
                            max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of leading blocks cached in group 0's map (read-only).

        Args:
            hashes: the sequence's full-block hashes.
            token_ids: the sequence, to verify each hit's stored tokens (None: by hash alone,
                for the read-only :meth:`lookup_prefix`, which hands out no KV).
            max_blocks: cap on the hit (callers pass ``(num_tokens - 1) // block_size``).

        Returns:
            The hit blocks, in order. A block whose stored tokens differ from the sequence's
            (a hash collision) ends the run: a miss, never wrong KV.
        """
        bs = self._block_size
        cached = self._pool.cached
        hits: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = cached.get(hashes[i])
            start = i * bs
            if block is None or (token_ids is not None
                                 and block.token_ids != tuple(token_ids[start : start + bs])):
                break
            hits.append(block)
        return hits

    def _get_new_blocks(self, n: int, evicted: list[EvictedBlock],
                        events: list[KVEvent] | None) -> list[KVCacheBlock]:
        first = len(evicted)
        blocks = self._pool.get_new_blocks(n, evicted)
        if events is not None and len(evicted) > first:
            events.append(BlockRemoved(tuple([e.block_hash for e in evicted[first:]])))
        return blocks

    def _cache_full_blocks(self, state: RequestState, num_full_computed: int,
                           events: list[KVEvent] | None) -> None:
        """Registers the request's full blocks that are known and computed by the end of the step.

        A block whose hash another block already serves (computed concurrently by another
        request) stays unregistered, and the existing mapping wins.
        """
        start = state.num_cached_blocks
        end = min(num_full_computed, len(state.block_hashes))
        if end <= start:
            return
        bs = self._block_size
        hashes, blocks = state.block_hashes, state.blocks
        cache_block = self._pool.cache_block
        stored: list[int] = []
        tokens = [state.block_tokens(i, bs) for i in range(start, end)]
        for i in range(start, end):
            if cache_block(blocks[i], hashes[i], tokens[i - start]):
                stored.append(i)
        null = self._pool.null_block
        for g in range(1, self._num_groups):
            # NOTE: a window group's position here is never the null block (positions at or past
            # num_cached_blocks were allocated fresh and die at a later step at the earliest); the
            # check keeps the null block out of every map even so.
            table = state.tables[g]
            for i in range(start, end):
                if table[i] is not null:
                    cache_block(table[i], hashes[i], tokens[i - start], g)
        state.mark_cached(end, bs)
        if events is not None and stored:
            self._stored_events(state, stored, events)

    def _stored_events(self, state: RequestState, stored: list[int], events: list[KVEvent]) -> None:
        """One BlockStored per contiguous run of newly registered blocks, with its parent hash."""
        hashes, blocks, bs = state.block_hashes, state.blocks, self._block_size
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            events.append(BlockStored(
                block_hashes=tuple(hashes[first : last + 1]),
                parent_block_hash=hashes[first - 1] if first else None,
                block_size=bs,
                num_tokens=(last + 1 - first) * bs,
                block_ids=tuple([block.block_id for block in blocks[first : last + 1]]),
            ))
            run_start = k

    # ------------------------------------------------------------------ queries

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixLookup:
        """How many leading blocks of a hash chain are cached; changes nothing (not even LRU order).

        The same hit rule as a step's (every group; ``block_ids`` group-major, 0 before a window).
        By hash alone (no tokens travel): an estimate for routers and tests. Reusing a block
        (``step``) also compares its token ids.
        """
        validate_hashes(block_hashes, "lookup")
        bs = self._block_size
        if len(block_hashes) * bs > self._config.max_model_len:
            raise InvalidArgument(f"{len(block_hashes)} blocks of {bs} tokens exceed max_model_len "
                                  f"{self._config.max_model_len}")
        num_hit, tables = self._find_hit(block_hashes, None, len(block_hashes))
        return PrefixLookup(num_hit * bs, tuple([b.block_id for table in tables for b in table]))

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the prefix cache serves now (in use or free): a snapshot's contents.

        Group 0's map, the one the events speak of (docs/design.md, "Block tables per group (kv-cache-manager)")."""
        return tuple(self._pool.cached)

    def get_block_table(self, request_id: str) -> BlockTable:
        """A live request's blocks (group-major, 0 where a window slid past), known token count and
        computed full-block hashes."""
        state = self._requests.get(request_id)
        if state is None:
            raise NotFound(f"request {request_id!r} is not live")
        return BlockTable(tuple([b.block_id for table in state.tables for b in table]), state.num_tokens,
                          tuple(state.block_hashes[: state.num_cached_blocks]))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; returns how many blocks were cached.

        Raises:
            FailedPrecondition: some block is in use (its request may still rely on its hash).
        """
        pool = self._pool
        if pool.num_free_blocks != pool.num_usable_blocks:
            raise FailedPrecondition(f"{pool.num_usable_blocks - pool.num_free_blocks} blocks in use")
        events = self._begin_events()
        num = pool.reset_prefix_cache()
        if events is not None:
            events.append(AllBlocksCleared())
        self._publish(events)
        return num

    def stats(self) -> KVCacheStats:
        """Pool usage and cumulative prefix-cache counters."""
        pool = self._pool
        usable = pool.num_usable_blocks
        free = pool.num_free_blocks
        return KVCacheStats(
            num_blocks=usable,
            num_free_blocks=free,
            num_cached_blocks=pool.num_cached_blocks,
            usage_percent=(usable - free) / usable * 100.0,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            recompute_queries=self._recompute_queries,
            recompute_hits=self._recompute_hits,
            num_requests=len(self._requests),
            block_size=self._block_size,
            num_evictions=pool.num_evictions,
        )

    def check_integrity(self) -> None:
        """Re-derives the accounting; raises IntegrityError on any mismatch."""
        check_integrity(self._pool, self._requests.values(), self._block_size, self._windows, self._sinks)

    # ------------------------------------------------------------------ events

    def _begin_events(self) -> list[KVEvent] | None:
        """A list to collect this operation's events, or None when nobody listens (no cost)."""
        hub = self._hub
        return [] if hub is not None and hub.has_subscribers else None

    def _publish(self, events: list[KVEvent] | None) -> None:
        if events and self._hub is not None:
            self._hub.publish(events)
