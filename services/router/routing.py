"""A request's tokens and tenant -> a :class:`Decision` over the healthy replicas (no grpc here).

Glue of the three core parts: :mod:`prefix` (the request's block hashes, as its replica will
compute them), :mod:`index` (who holds which) and :mod:`scoring` (hits against load). The
decision goes to the log, the current (server) span's attributes and the metrics, in one place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

from opentelemetry import trace

from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.offload_index import OffloadIndex
from services.router.prefix import request_hashes
from services.router.scoring import Scorer
from services.router.types import Decision, ReplicaLoad
from shared.span_attributes import set_attributes

log = logging.getLogger(__name__)


class Candidate(Protocol):
    """What routing needs of a replica (``client.Replica`` is one)."""

    id: str

    @property
    def has_offload(self) -> bool: ...

    def load(self) -> ReplicaLoad: ...


class Router:
    """Decides where each request goes; thread-safe (its parts are)."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, metrics: RouterMetrics | None = None,
                 offload: OffloadIndex | None = None) -> None:
        self.config = config
        self.index = index
        self.offload = offload if offload is not None else OffloadIndex()
        self.scorer = Scorer(config)
        self.metrics = metrics

    def decide(self, candidates: Sequence[Candidate], token_ids: Sequence[int], tenant_id: str,
               client_salt: str, model_id: str, block_size: int, *, record: bool = True) -> Decision:
        """Scores ``candidates`` for the prompt ``token_ids`` of ``tenant_id``.

        Args:
            record: log the decision and count it (False for Explain, which routes nothing).
        """
        cfg = self.config
        hashes = request_hashes(cfg.deployment_key, model_id, block_size, token_ids, tenant_id, client_salt)
        ids = [c.id for c in candidates]
        matches = self.index.match(hashes, ids)
        offload = self.offload.extend(hashes, matches, [c.id for c in candidates if c.has_offload])
        decision = self.scorer.decide(len(hashes), ids, matches, {c.id: c.load() for c in candidates}, offload)
        decision = dataclasses.replace(decision, hashes=tuple(hashes))
        if record:
            self._record(decision)
        return decision

    def sending(self, replica_id: str, decision: Decision) -> None:
        """The request is being forwarded to ``replica_id``: predict its blocks there.

        NOTE: called before the forward, so the replica's store events always come after it.
        """
        if self.config.predict_seconds > 0:
            self.index.predict(replica_id, decision.hashes, self.config.predict_seconds)

    def not_sent(self, replica_id: str, decision: Decision) -> None:
        """``replica_id`` refused or failed before the first token: take its prediction back."""
        self.index.unpredict(replica_id, decision.hashes)

    def _record(self, decision: Decision) -> None:
        parts = " ".join(f"{s.replica_id}:matched={s.matched_blocks},dram={s.offload.dram},disk={s.offload.disk},"
                         f"remote={s.offload.remote},in_flight={s.in_flight},kv={s.kv_usage:.2f},cost={s.cost:.1f}"
                         for s in decision.scores)
        log.info("route %s -> %s (%d/%d blocks held) [%s]", decision.policy, decision.replica_id or "-",
                 decision.matched_blocks, decision.total_blocks, parts)
        # NOTE: ids from the router's configuration and counts only: no request content.
        set_attributes(trace.get_current_span(), {  # the Generate call's server span
            "kvmesh.router.replica": decision.replica_id, "kvmesh.router.policy": decision.policy,
            "kvmesh.router.matched_blocks": decision.matched_blocks,
            "kvmesh.router.total_blocks": decision.total_blocks,
            "kvmesh.router.offload_dram_blocks": decision.offload.dram,
            "kvmesh.router.offload_disk_blocks": decision.offload.disk,
            "kvmesh.router.offload_remote_blocks": decision.offload.remote,
            "kvmesh.router.cost": decision.scores[0].cost if decision.scores else 0.0,
            "kvmesh.router.candidates": len(decision.scores),
        })
        if self.metrics is not None:
            self.metrics.record(decision)
