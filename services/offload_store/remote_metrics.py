"""Prometheus view of the remote tier's counters, read at scrape time.

A collector rather than counters bumped by the servicer: the remote tier's :class:`RemoteStats`
stay the one owner of the numbers, and the servicer needs no change to export them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.offload_store.remote_tier import RemoteStats, RemoteTier
from shared.metrics import MODEL_LABEL, PREFIX

_HELP = {
    "hits": "Blocks served by the remote tier (format and checksum verified).",
    "misses": "Blocks asked of the remote tier and absent.",
    "mismatches": "Remote blocks of another format or version: served as misses.",
    "corruptions": "Remote blocks with a bad length or checksum: served as misses and deleted.",
    "saves": "Blocks written to the remote tier.",
    "skipped_saves": "Blocks not written because the remote tier already held them.",
    "errors": "Remote calls that failed (Redis down, refused or slower than the timeout).",
    "bypassed": "Remote calls not attempted while backing off after an error.",
    "bytes_read": "KV payload bytes served by the remote tier.",
    "bytes_written": "Value bytes written to the remote tier.",
    "round_trips": "Pipelines sent to the remote tier.",
}


class RemoteTierCollector(Collector):
    """``kvmesh:offload_remote_<counter>_total`` for every field of :class:`RemoteStats`, and
    ``kvmesh:offload_remote_up`` (0 during an outage)."""

    def __init__(self, tier: RemoteTier, model_name: str) -> None:
        self._tier = tier
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats: RemoteStats = self._tier.stats
        for f in fields(RemoteStats):
            family = CounterMetricFamily(f"{PREFIX}offload_remote_{f.name}", _HELP[f.name], labels=[MODEL_LABEL])
            family.add_metric([self._model], getattr(stats, f.name))
            yield family
        up = GaugeMetricFamily(f"{PREFIX}offload_remote_up", "0 while the remote tier is failing, else 1.",
                               labels=[MODEL_LABEL])
        up.add_metric([self._model], 0 if self._tier.last_error else 1)
        yield up
