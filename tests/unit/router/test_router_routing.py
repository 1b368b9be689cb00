"""The router core end to end without a network: a request's tenant-salted hashes against the index,
the decision, and its record as span attributes and Prometheus samples (exact values)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.kv_cache_manager.types import BlockStored, KVEventBatch
from services.offload_store.types import OffloadEventBatch, StoredBlocks, TierEvent
from services.router.config import RouterConfig
from services.router.disagg import uncached_tokens
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.offload_index import OffloadIndex
from services.router.prefix import request_hashes
from services.router.routing import Router
from services.router.types import OffloadMatch, ReplicaLoad
from shared.metrics import new_registry


@dataclass
class Fake:
    """A candidate replica: an id and a load (what Router reads; the real one is client.Replica)."""

    id: str
    in_flight: int = 0
    has_offload: bool = False

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.in_flight, 0.0)


def test_decision_uses_the_tenants_hashes_and_is_recorded() -> None:
    cfg = RouterConfig(deployment_key="dk", predict_seconds=0)  # the events' view only (predictions: below)
    tokens = list(range(10, 30))  # 5 blocks of 4
    index = PrefixIndex()
    held = request_hashes("dk", "m", 4, tokens, "team-a")[:3]
    index.apply("b", KVEventBatch(1, (BlockStored(tuple(held), None, 4, 12, (1, 2, 3)),)))
    registry = new_registry(process_collectors=False)
    router = Router(cfg, index, RouterMetrics(registry))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("Generate"):
        d = router.decide([Fake("a"), Fake("b")], tokens, "team-a", "", "m", 4)
    assert (d.replica_id, d.matched_blocks, d.total_blocks) == ("b", 3, 5)
    assert [(s.replica_id, s.cost) for s in d.scores] == [("b", 2.0), ("a", 5.0)]
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    assert attrs == {"kvmesh.router.replica": "b", "kvmesh.router.policy": "kv_aware",
                     "kvmesh.router.matched_blocks": 3, "kvmesh.router.total_blocks": 5,
                     "kvmesh.router.cost": 2.0, "kvmesh.router.candidates": 2,
                     "kvmesh.router.offload_dram_blocks": 0, "kvmesh.router.offload_disk_blocks": 0,
                     "kvmesh.router.offload_remote_blocks": 0}
    # Another tenant's hashes differ from block 0 on: no hit anywhere.
    other = router.decide([Fake("a"), Fake("b")], tokens, "team-b", "", "m", 4)
    assert [s.matched_blocks for s in other.scores] == [0, 0]
    assert other.replica_id == "b"  # a tie: the rotation's second turn starts at b
    # Explain does not count; a busy holder loses to an idle miss (2 + 4 x 1 > 5).
    busy = router.decide([Fake("a"), Fake("b", in_flight=1)], tokens, "team-a", "", "m", 4, record=False)
    assert busy.replica_id == "a"
    sample = registry.get_sample_value
    assert sample("kvmesh:router_decisions_total", {"replica": "b", "policy": "kv_aware"}) == 2.0
    assert sample("kvmesh:router_matched_blocks_total", {"replica": "b"}) == 3.0
    assert sample("kvmesh:router_prompt_blocks_total") == 10.0  # two recorded decisions of 5 blocks


def test_a_routed_requests_blocks_are_predicted_on_its_replica_until_events_confirm() -> None:
    """A burst of one prefix: without predictions each decision comes before the first prefill's
    events, so ties rotate and the prefix is computed on both replicas; with them the second
    request follows the first."""
    tokens = list(range(10, 30))  # 5 blocks of 4
    hashes = request_hashes("dk", "m", 4, tokens, "team-a")
    off = Router(RouterConfig(deployment_key="dk", predict_seconds=0), PrefixIndex())
    first, second = (off.decide([Fake("a"), Fake("b")], tokens, "team-a", "", "m", 4) for _ in range(2))
    assert (first.replica_id, second.replica_id, second.matched_blocks) == ("a", "b", 0)
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    on = Router(RouterConfig(deployment_key="dk", predict_seconds=10), index)
    first = on.decide([Fake("a"), Fake("b")], tokens, "team-a", "", "m", 4)
    assert first.hashes == tuple(hashes)
    on.sending(first.replica_id, first)  # what the servicer does before forwarding
    second = on.decide([Fake("a"), Fake("b")], tokens, "team-a", "", "m", 4)
    assert (first.replica_id, second.replica_id, second.matched_blocks) == ("a", "a", 5)
    on.not_sent("a", first)  # "a" refused it; the retry goes to "b", which is predicted instead
    on.sending("b", first)
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 5}
    assert index.blocks("b") == frozenset() and index.num_blocks("b") == 0  # the real view: nothing yet
    other = on.decide([Fake("a"), Fake("b")], tokens, "team-b", "", "m", 4, record=False)
    assert [s.matched_blocks for s in other.scores] == [0, 0]  # other tenants' hashes differ
    now[0] = 110.0  # the replica never stored them (refused, failed): the prediction lapses
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 0}


def test_offload_tiers_extend_the_pool_match_at_their_weights() -> None:
    """6 blocks. b's pool holds 0-1 and its disk 2; a's DRAM holds 0-3, and a's store wrote 4-5 to
    the shared remote tier. a: 4 DRAM + 2 remote = 6 - (0.5 x 4 + 0.3 x 2) = 3.4; b: 6 - 2 - 0.3 x 1
    = 3.7 (block 3 is in no tier b reaches: its chain stops there). Remote blocks count for every
    replica with a store, wherever they were reported."""
    cfg = RouterConfig(deployment_key="dk", predict_seconds=0)  # weights: DRAM 0.5, disk 0.3, remote 0.3
    tokens = list(range(10, 34))
    h = request_hashes("dk", "m", 4, tokens, "team-a")
    index = PrefixIndex()
    index.apply("b", KVEventBatch(1, (BlockStored(tuple(h[:2]), None, 4, 8, (1, 2)),)))
    offload = OffloadIndex()
    offload.replace("a", StoredBlocks(7, dram=tuple(h[:4])))
    assert offload.apply("a", OffloadEventBatch(8, (TierEvent("remote", True, tuple(h[4:])),)))
    assert not offload.apply("a", OffloadEventBatch(10, ()))  # a gap: refused, nothing applied
    offload.replace("b", StoredBlocks(3, disk=(h[2],)))
    registry = new_registry(process_collectors=False)
    router = Router(cfg, index, RouterMetrics(registry), offload)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("Generate"):
        d = router.decide([Fake("a", has_offload=True), Fake("b", has_offload=True)], tokens, "team-a", "", "m", 4)
    assert [(s.replica_id, s.matched_blocks, s.offload, round(s.cost, 6)) for s in d.scores] == [
        ("a", 0, OffloadMatch(dram=4, remote=2), 3.4), ("b", 2, OffloadMatch(disk=1, remote=0), 3.7)]
    assert uncached_tokens(d, 4, len(tokens)) == 0  # every block loads: nothing to prefill
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    assert (attrs["kvmesh.router.offload_dram_blocks"], attrs["kvmesh.router.offload_disk_blocks"],
            attrs["kvmesh.router.offload_remote_blocks"]) == (4, 0, 2)
    sample = registry.get_sample_value
    assert [sample("kvmesh:router_offload_matched_blocks_total", {"replica": "a", "tier": t})
            for t in ("dram", "disk", "remote")] == [4.0, 0.0, 2.0]
    # A replica whose store the router does not follow gets no offload credit: pool only.
    plain = router.decide([Fake("a"), Fake("b")], tokens, "team-a", "", "m", 4, record=False)
    assert [(s.replica_id, s.offload, s.cost) for s in plain.scores] == [("b", OffloadMatch(), 4.0),
                                                                          ("a", OffloadMatch(), 6.0)]
    # A weight of 0 turns a tier off; a removal takes the block out of the chain.
    offload.apply("a", OffloadEventBatch(9, (TierEvent("dram", False, (h[1],)),)))
    no_remote = Router(RouterConfig(deployment_key="dk", predict_seconds=0, offload_weight_remote=0), index,
                       offload=offload)
    d2 = no_remote.decide([Fake("a", has_offload=True)], tokens, "team-a", "", "m", 4, record=False)
    assert (d2.offload, d2.scores[0].cost) == (OffloadMatch(dram=1), 5.5)
