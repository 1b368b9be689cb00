"""The offload-store's Prometheus metrics: traffic in blocks and bytes held, by tier.

The group lives with the service that owns the facts it counts (the servicer mirrors the core's
counters into it); the naming rules and the shared label are ``shared/metrics.py``'s.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.metrics import MODEL_LABEL, PREFIX

OFFLOAD_TIERS = ("dram", "disk")


class OffloadMetrics:
    """Offload-store traffic in blocks, by tier (``dram`` or ``disk``).

    A *miss* is a block asked for and found in no tier; a *corruption* is a disk block whose
    checksum failed (it is then treated as a miss and deleted).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        tiered = [MODEL_LABEL, "tier"]
        self._model = model_name
        self._hits = Counter(PREFIX + "offload_hits", "Blocks served from the offload store.",
                             tiered, registry=registry)
        self._saves = Counter(PREFIX + "offload_saves", "Blocks written to the offload store.",
                              tiered, registry=registry)
        self._corruptions = Counter(PREFIX + "offload_corruptions",
                                    "Blocks that failed their checksum on load.", tiered, registry=registry)
        self._stored_bytes = Gauge(PREFIX + "offload_stored_bytes", "Bytes held per tier.",
                                   tiered, registry=registry)
        self.misses = Counter(PREFIX + "offload_misses", "Blocks asked for and found in no tier.",
                              [MODEL_LABEL], registry=registry).labels(model_name)
        self.pool_attached = Gauge(PREFIX + "offload_pool_attached",
                                   "1 while a runner KV pool is mapped; 0: every save and load is refused.",
                                   [MODEL_LABEL], registry=registry).labels(model_name)
        self.refused_no_pool = Counter(PREFIX + "offload_refused_no_pool",
                                       "Save and Load calls refused because no KV pool was attached.",
                                       [MODEL_LABEL], registry=registry).labels(model_name)
        # Touch every tier so dashboards show 0 instead of "no data" before the first event.
        for tier in OFFLOAD_TIERS:
            for family in (self._hits, self._saves, self._corruptions, self._stored_bytes):
                family.labels(model_name, tier)

    def _tier(self, tier: str) -> str:
        if tier not in OFFLOAD_TIERS:
            raise ValueError(f"tier must be one of {OFFLOAD_TIERS}, not {tier!r}")
        return tier

    def hit(self, tier: str, blocks: int = 1) -> None:
        """Blocks found in ``tier``."""
        self._hits.labels(self._model, self._tier(tier)).inc(blocks)

    def miss(self, blocks: int = 1) -> None:
        """Blocks found in no tier."""
        self.misses.inc(blocks)

    def save(self, tier: str, blocks: int = 1) -> None:
        """Blocks written to ``tier``."""
        self._saves.labels(self._model, self._tier(tier)).inc(blocks)

    def corruption(self, tier: str, blocks: int = 1) -> None:
        """Blocks whose checksum failed in ``tier``."""
        self._corruptions.labels(self._model, self._tier(tier)).inc(blocks)

    def set_stored_bytes(self, tier: str, nbytes: int) -> None:
        """Bytes currently held in ``tier``."""
        self._stored_bytes.labels(self._model, self._tier(tier)).set(nbytes)
