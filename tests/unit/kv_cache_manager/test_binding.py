"""The kv-cache-manager's binding: unbound until Initialize, one owner with a lease, take-over
only after the lease lapsed or was released, cache kept only for the same runner pool."""

from __future__ import annotations

import dataclasses

import pytest

from services.kv_cache_manager.binding import ManagerBinding
from shared.errors import FailedPrecondition, InvalidArgument
from shared.ownership import Acquired, Lease, owner_from_metadata

from .helpers import lookup, make_manager, new, running, seq

A = seq(0, 55)  # 3 full blocks + 7 tokens


class Clock:
    """A manual monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bound(clock: Clock, owner: str = "s1", pool: str = "pool-1") -> ManagerBinding:
    binding = ManagerBinding(clock=clock)
    binding.initialize(owner, make_manager().config, pool, 10.0)
    return binding


def test_an_unbound_manager_serves_nothing() -> None:
    binding = ManagerBinding()
    for call in (binding.manager, lambda: binding.owned("s1"), lambda: binding.release("s1")):
        with pytest.raises(FailedPrecondition, match="not initialized"):
            call()


def test_another_owner_is_fenced_until_the_lease_lapses_then_takes_over_and_frees_everything() -> None:
    clock = Clock()
    binding = bound(clock)
    m = binding.owned("s1")
    m.step((), [new("a", A)])
    m.step((), [running("a", [7], 1)])  # a's KV is computed: its 3 full blocks are committed
    m.step((), [new("b", seq(900, 20))])
    clock.now += 9.0
    binding.owned("s1")  # a call renews the lease: 10 s from now
    clock.now += 9.5
    for call in (lambda: binding.owned("s2"),
                 lambda: binding.initialize("s2", make_manager(num_blocks=4).config, "pool-1", 10.0)):
        with pytest.raises(FailedPrecondition):
            call()
    assert binding.manager().stats().num_requests == 2  # nothing changed (and no renewal)
    clock.now += 0.6  # s1 went silent (SIGKILL): its lease lapses
    result = binding.initialize("s2", make_manager().config, "pool-1", 10.0)
    assert (result.acquired, result.kept_cache, result.num_freed_requests) == (Acquired.TAKEN_OVER, True, 2)
    stats = result.stats
    assert (stats.num_requests, stats.num_free_blocks, stats.num_cached_blocks) == (0, 10, 3)
    assert lookup(binding.owned("s2"), A) == 48  # same runner pool: still valid
    with pytest.raises(FailedPrecondition, match="not the owner"):
        binding.owned("s1")  # the fenced-out scheduler can change nothing
    binding.manager().check_integrity()


def test_a_new_runner_pool_or_other_geometry_drops_the_cache() -> None:
    clock = Clock()
    binding = bound(clock)
    binding.owned("s1").step((), [new("a", A)])
    binding.owned("s1").step((), [running("a", [7], 1)])
    result = binding.initialize("s1", make_manager().config, "pool-2", 10.0)  # the runner restarted
    assert (result.acquired, result.kept_cache, result.num_freed_requests) == (Acquired.RENEWED, False, 1)
    assert lookup(binding.owned("s1"), A) == 0
    assert binding.pool_id == "pool-2"
    config = dataclasses.replace(make_manager().config, num_blocks=21)
    result = binding.initialize("s1", config, "pool-2", 10.0)
    assert (result.kept_cache, result.stats.num_blocks) == (False, 20)


def test_release_hands_over_at_once() -> None:
    clock = Clock()
    binding = bound(clock)
    binding.owned("s1").step((), [new("a", A)])
    assert binding.release("s1") == 1
    result = binding.initialize("s2", make_manager().config, "pool-1", 10.0)
    assert (result.acquired, result.num_freed_requests) == (Acquired.NEW, 0)  # released: nobody owned it


def test_lease_input_checks() -> None:
    lease = Lease("x", "Initialize", clock=Clock())
    with pytest.raises(InvalidArgument, match="kvmesh-owner"):
        lease.acquire("", 1.0)
    with pytest.raises(InvalidArgument, match="lease_seconds"):
        lease.acquire("s1", 0.0)
    assert lease.acquire("s1", 1.0) is Acquired.NEW
    assert lease.acquire("s1", 1.0) is Acquired.RENEWED
    assert owner_from_metadata([("other", "v"), ("kvmesh-owner", b"s1")]) == "s1"
    assert owner_from_metadata(None) == ""
    with pytest.raises(InvalidArgument, match="at most 128 bytes"):
        owner_from_metadata([("kvmesh-owner", "x" * 129)])
