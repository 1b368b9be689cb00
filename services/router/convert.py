"""The router's own messages (``kvmesh.v1.Router``): its dataclasses -> protobuf.

The public API it serves is the scheduler's and passes through unconverted (the router forwards
a replica's stream as it is), so only the operators' view needs converting, and only one way:
nothing calls the Router API with a decision or a replica state.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.router.client import Replica
from services.router.types import Decision
from shared.pb.kvmesh.v1 import router_pb2


def decision_to_pb(decision: Decision) -> router_pb2.RouteDecision:
    """A decision (the chosen replica, its match and every candidate's cost parts)."""
    return router_pb2.RouteDecision(
        replica_id=decision.replica_id, policy=decision.policy, total_blocks=decision.total_blocks,
        matched_blocks=decision.matched_blocks,
        scores=[router_pb2.ReplicaScore(id=s.replica_id, matched_blocks=s.matched_blocks, cost=s.cost,
                                        in_flight=s.in_flight, kv_usage=s.kv_usage, dram_blocks=s.offload.dram,
                                        disk_blocks=s.offload.disk, remote_blocks=s.offload.remote)
                for s in decision.scores])


def replica_state_to_pb(replica: Replica, last_seq: int, num_indexed_blocks: int,
                        offload_blocks: Mapping[str, int] | None = None) -> router_pb2.ReplicaState:
    """One replica as the router sees it: health, event streams, what the indexes hold of it.

    ``offload_blocks``: what the offload index holds of it, by tier.
    """
    tiers = offload_blocks or {}
    return router_pb2.ReplicaState(
        id=replica.id, scheduler_address=replica.address.scheduler_address, healthy=replica.healthy,
        subscribed=replica.subscribed, last_seq=last_seq, num_indexed_blocks=num_indexed_blocks,
        in_flight=replica.in_flight, kv_usage=replica.kv_usage, subscriptions=replica.subscriptions,
        offload_address=replica.address.offload_address, offload_subscribed=replica.offload_subscribed,
        num_dram_blocks=tiers.get("dram", 0), num_disk_blocks=tiers.get("disk", 0),
        num_remote_blocks=tiers.get("remote", 0))
