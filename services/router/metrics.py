"""The router's Prometheus metrics: every decision, its prefix match, retries and index resyncs.

Routing hit rate = ``rate(kvmesh:router_matched_blocks_total) / rate(kvmesh:router_prompt_blocks_total)``:
the share of prompt blocks the chosen replica already held when the request was routed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.router.types import Decision
from shared.metrics import PREFIX

RETRY_REASONS = ("unavailable", "refused")
RESYNC_REASONS = ("gap", "disconnect")
PD_OUTCOMES = ("split", "refused", "prefill_failed")  # services/router/disagg.py


class RouterMetrics:
    """One group, owned by the router process (shared/metrics.py keeps the services' groups)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(PREFIX + "router_decisions", "Requests routed, by chosen replica and policy.",
                                 ["replica", "policy"], registry=registry)
        self.matched_blocks = Counter(PREFIX + "router_matched_blocks",
                                      "Prompt blocks the chosen replica held when routed.", ["replica"],
                                      registry=registry)
        self.prompt_blocks = Counter(PREFIX + "router_prompt_blocks", "Full prompt blocks of routed requests.",
                                     registry=registry)
        self.retries = Counter(PREFIX + "router_retries",
                               "Generate attempts moved to another replica before the first token.",
                               ["reason"], registry=registry)
        self.resyncs = Counter(PREFIX + "router_index_resyncs",
                               "Times a replica's index entries were resynced from a snapshot (gap, reconnect), "
                               "by index: its pool or its offload-store's tiers.",
                               ["replica", "reason", "index"], registry=registry)
        self.offload_blocks = Counter(PREFIX + "router_offload_matched_blocks",
                                      "Prompt blocks past the pool match the chosen replica's offload-store held "
                                      "when routed, by tier (dram, disk, remote).", ["replica", "tier"],
                                      registry=registry)
        self.offload_indexed = Gauge(PREFIX + "router_offload_indexed_blocks",
                                     "Block hashes indexed per replica's offload-store tier.", ["replica", "tier"],
                                     registry=registry)
        self.indexed_blocks = Gauge(PREFIX + "router_indexed_blocks", "Block hashes indexed per replica.",
                                    ["replica"], registry=registry)
        self.healthy = Gauge(PREFIX + "router_replica_healthy", "1 when the replica answered its last probe.",
                             ["replica"], registry=registry)
        self.pd = Counter(PREFIX + "router_pd_requests",
                          "Long uncached prompts with a prefill replica healthy: split in two legs, refused "
                          "(sampling that cannot be continued: sent whole), or prefill_failed (leg 1 gave "
                          "no token: sent whole).", ["outcome"], registry=registry)
        for outcome in PD_OUTCOMES:
            self.pd.labels(outcome)

    def record(self, decision: Decision) -> None:
        """One routing decision (its first candidate is where the request went first)."""
        if not decision.scores:
            return
        self.decisions.labels(decision.replica_id, decision.policy).inc()
        self.matched_blocks.labels(decision.replica_id).inc(decision.matched_blocks)
        self.prompt_blocks.inc(decision.total_blocks)
        o = decision.offload
        for tier, n in (("dram", o.dram), ("disk", o.disk), ("remote", o.remote)):
            self.offload_blocks.labels(decision.replica_id, tier).inc(n)
