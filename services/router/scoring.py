"""Picks a replica for a request: prefix hits against load, or plain rotation.

``kv_aware`` minimises, over the healthy replicas::

    cost = prefill_weight x (blocks to compute - sum over tiers of weight_tier x blocks loaded from tier)
           + request_weight x (streams open) + kv_usage_weight x (KV usage)

in units of blocks (the same shape as Dynamo's KV router: overlap against load), so a replica
holding the prefix wins until its load outweighs the prefill it saves, which is the
load-balance escape. Ties go round the replicas (a rotating start), so cold prefixes spread
instead of piling on the first replica. ``round_robin`` ignores the scores (it still reports
them, so the two policies can be compared on the same metrics).

Blocks past the pool match that the replica's offload-store would load (its DRAM, its disk, the
shared remote tier; services/router/offload_index.py) are not computed either, but cost a copy,
so each is credited only ``offload_weight_<tier>`` of a prefill block: the pool still wins over
DRAM, DRAM over disk, and any of them over a replica that holds nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from services.router.config import RouterConfig
from services.router.types import Decision, OffloadMatch, ReplicaLoad, ReplicaScore


class Scorer:
    """Turns matches and loads into a :class:`Decision`; holds only the rotation counter."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._turn = 0

    def _next_turn(self) -> int:
        with self._lock:
            turn = self._turn
            self._turn += 1
            return turn

    def decide(self, total_blocks: int, candidates: Sequence[str], matches: Mapping[str, int],
               loads: Mapping[str, ReplicaLoad], offload: Mapping[str, OffloadMatch] | None = None) -> Decision:
        """Scores ``candidates`` (healthy replicas, in configuration order), best first.

        Args:
            total_blocks: full blocks of the request's prompt.
            candidates: the replicas to consider.
            matches: leading blocks each one holds (missing: 0).
            loads: each one's load (missing: idle).
            offload: blocks past each one's pool match its offload-store would load (missing: none).
        """
        cfg = self._config
        n = len(candidates)
        turn = self._next_turn() if n else 0
        scores: list[tuple[float, int, ReplicaScore]] = []
        for pos, rid in enumerate(candidates):
            matched = min(matches.get(rid, 0), total_blocks)
            load = loads.get(rid, ReplicaLoad())
            off = (offload or {}).get(rid, OffloadMatch())
            saved = (cfg.offload_weight_dram * off.dram + cfg.offload_weight_disk * off.disk
                     + cfg.offload_weight_remote * off.remote)
            cost = (cfg.prefill_weight * (total_blocks - matched - saved) + cfg.request_weight * load.in_flight
                    + cfg.kv_usage_weight * load.kv_usage)
            rotation = (pos - turn) % n
            scores.append((cost, rotation, ReplicaScore(rid, matched, cost, load.in_flight, load.kv_usage, off)))
        if cfg.policy == "round_robin":
            scores.sort(key=lambda s: s[1])
        else:
            scores.sort(key=lambda s: (s[0], s[1]))
        return Decision(cfg.policy, total_blocks, tuple(s[2] for s in scores))
