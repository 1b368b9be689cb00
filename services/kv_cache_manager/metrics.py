"""The kv-cache-manager's Prometheus metrics: block pool occupancy and prefix cache effectiveness."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.metrics import MODEL_LABEL, PREFIX


class KVCacheMetrics:
    """Block pool occupancy and prefix cache effectiveness (the kv-cache-manager's view).

    Hit rate = ``rate(kvmesh:prefix_cache_hits_total) / rate(kvmesh:prefix_cache_queries_total)``,
    both in tokens as in vLLM, so long and short prompts weigh by what they save.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = [MODEL_LABEL]
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of KV blocks in use by requests (1 = 100%); cached free blocks count as free.",
            labels, registry=registry).labels(model_name)
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels, registry=registry).labels(model_name)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache (KV not recomputed).",
            labels, registry=registry).labels(model_name)

    def set_usage(self, used_blocks: int, usable_blocks: int) -> None:
        """Pool occupancy; ``usable_blocks`` excludes the null block 0."""
        self.kv_cache_usage_perc.set(used_blocks / usable_blocks if usable_blocks > 0 else 0.0)

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """One prefix lookup: tokens asked about and tokens served from cache."""
        if hit_tokens > queried_tokens:
            raise ValueError("hit_tokens cannot exceed queried_tokens")
        self.prefix_cache_queries.inc(queried_tokens)
        self.prefix_cache_hits.inc(hit_tokens)
