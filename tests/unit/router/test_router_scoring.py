"""The scorer's exact costs and orders, both policies, and the request hashes it is fed."""

from __future__ import annotations

import pytest

from services.kv_cache_manager.client import InProcessKVCache
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.manager import KVCacheManager
from services.model_runner.client import RunnerInfo
from services.router.config import RouterConfig
from services.router.prefix import replica_hash_seed, request_hashes
from services.router.scoring import Scorer
from services.router.types import ReplicaAddress, ReplicaLoad
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request, RequestSpec
from services.scheduler.scheduler import Scheduler
from shared.auth import tenant_cache_salt
from shared.hashing import hash_seed
from shared.sampling_params import SamplingParams


def order(decision) -> list[str]:  # type: ignore[no-untyped-def]
    return [s.replica_id for s in decision.scores]


def test_kv_aware_cost_is_prefill_plus_load() -> None:
    scorer = Scorer(RouterConfig(prefill_weight=1.0, request_weight=4.0, kv_usage_weight=8.0))
    d = scorer.decide(10, ["a", "b", "c"], {"a": 8, "b": 10},
                      {"a": ReplicaLoad(1, 0.5), "b": ReplicaLoad(3, 0.0), "c": ReplicaLoad(0, 0.0)})
    # a: 2 blocks to compute + 1 stream x 4 + 0.5 x 8 = 10; b: 0 + 12 + 0 = 12; c: 10 + 0 + 0 = 10.
    assert [(s.replica_id, s.matched_blocks, s.cost) for s in d.scores] == [("a", 8, 10.0), ("c", 0, 10.0),
                                                                           ("b", 10, 12.0)]
    assert (d.replica_id, d.matched_blocks, d.total_blocks, d.policy) == ("a", 8, 10, "kv_aware")


def test_the_load_escape_overrides_a_hit() -> None:
    scorer = Scorer(RouterConfig())
    busy = {"a": ReplicaLoad(5, 0.9), "b": ReplicaLoad(0, 0.0)}
    assert scorer.decide(16, ["a", "b"], {"a": 16}, busy).replica_id == "b"  # 20 + 7.2 > 16
    assert scorer.decide(32, ["a", "b"], {"a": 32}, busy).replica_id == "a"  # 27.2 < 32


def test_ties_rotate_and_round_robin_ignores_hits() -> None:
    kv = Scorer(RouterConfig())
    assert [kv.decide(4, ["a", "b", "c"], {}, {}).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    rr = Scorer(RouterConfig(policy="round_robin"))
    picks = [rr.decide(4, ["a", "b"], {"a": 4}, {}) for _ in range(4)]
    assert [d.replica_id for d in picks] == ["a", "b", "a", "b"]
    assert [d.matched_blocks for d in picks] == [4, 0, 4, 0]  # reported even when not used
    assert order(picks[1]) == ["b", "a"]
    assert kv.decide(4, [], {}, {}).replica_id == ""


def test_request_hashes_are_the_replicas() -> None:
    tokens = list(range(3, 40))
    assert replica_hash_seed("k", "m") == hash_seed(b"k", "m")
    ours = request_hashes("k", "m", 4, tokens, "team-a", "s1")
    # The replica's own code path: its scheduler (seeded as its engine seeds it, from the deployment
    # key and the model id) hashes the request salted for the tenant as its servicer salts it, and
    # the kv-cache-manager registers the hashes it is sent.
    manager = KVCacheManager(CacheConfig(block_size=4, num_blocks=32, max_model_len=64, model_id="m"))
    info = RunnerInfo(model_id="m", vocab_size=100, max_model_len=64, eos_token_ids=(), num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(deployment_key="k"), InProcessKVCache(manager), info,
                      hash_seed=hash_seed(b"k", "m"))
    spec = RequestSpec("r", tuple(tokens), SamplingParams(), 1, cache_salt=tenant_cache_salt("k", "team-a", b"s1"))
    sched.add(Request(spec, seq=0))
    assert sched.schedule() is not None
    assert ours == list(manager.get_block_table("r").block_hashes)
    assert len(ours) == 9
    assert request_hashes("k", "m", 4, tokens, "team-b", "s1")[0] != ours[0]  # tenants never share


def test_replica_list_parsing() -> None:
    cfg = RouterConfig(replicas="a=h:1/h:2, h:3/h:4")
    assert cfg.replica_addresses() == (ReplicaAddress("a", "h:1", "h:2"), ReplicaAddress("r1", "h:3", "h:4"))
    for bad in ("h:1", "a=h:1/", "a=h:1/h:2,a=h:3/h:4"):
        with pytest.raises(ValueError, match="KVMESH_ROUTER_REPLICAS"):
            RouterConfig(replicas=bad)
    with pytest.raises(ValueError, match="POLICY"):
        RouterConfig(policy="random")
