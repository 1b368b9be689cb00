"""The router's frozen configuration (read from ``KVMESH_ROUTER_*`` in main.py only)."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.discovery import DiscoveryTarget
from services.router.types import ReplicaAddress

POLICIES = ("kv_aware", "round_robin")
ROLES = ("mixed", "prefill", "decode")  # the scheduler's KVMESH_SCHED_ROLE values


@dataclass(frozen=True)
class RouterConfig:
    """Which replicas, how to pick one, how often to look at them.

    Attributes:
        replicas: comma-separated ``id=scheduler_host:port/kv_cache_manager_host:port[/role][/offload_host:port]``
            entries (``id=`` optional: ``r0``, ``r1``, ... by position; role ``mixed`` unless
            ``prefill`` or ``decode`` is given; the optional last address is the replica's
            offload-store, whose tier events the router then follows). Empty with ``discovery_name``.
        discovery_name: instead of ``replicas``, a DNS name (a headless Service) whose A/AAAA
            records are the replicas, resolved every ``discovery_interval_seconds``
            (services/router/discovery.py); each address serves its scheduler on
            ``discovery_scheduler_port`` and its kv-cache-manager on ``discovery_kvm_port``, and
            its offload-store on ``discovery_offload_port`` (0: not followed).
        policy: ``kv_aware`` (least cost, below) or ``round_robin`` (the plain load balancer).
        prefill_weight: cost of one block the chosen replica must compute (a miss).
        request_weight: cost of one Generate stream already open on the replica, in blocks.
        kv_usage_weight: cost of a full pool (usage 1.0), in blocks; scales linearly.
        offload_weight_dram / offload_weight_disk / offload_weight_remote: the share of a prefill
            block's cost a block past the pool match saves when the replica's offload-store holds
            it in that tier (its DRAM, its disk, the shared remote tier): such a block costs
            ``prefill_weight x (1 - weight)``, a copy instead of a prefill (docs/mesh.md). 0 = not credited.
        predict_seconds: how long a routed request's blocks count as held by its replica before
            that replica's events store them (services/router/index.py, predictions); 0 = off.
        deployment_key: the replicas' deployment key: it roots the hash chain and the tenant salt.
        model_dir: tokenizer folder (the replicas' model); empty: ask a replica's Tokenize RPC.
        health_interval_seconds: how often each replica's health and KV stats are probed.
        rpc_timeout_seconds: deadline of a probe or a unary forward.
        reconnect_min_seconds / reconnect_max_seconds: backoff of event-stream reconnects.
        ready_timeout_seconds: at start, how long to wait for every replica before serving anyway.
        pd_threshold_tokens: prefill/decode disaggregation (services/router/disagg.py): a request
            whose uncached prompt on the best decode candidate is longer than this many tokens
            goes first to a prefill replica (when one is healthy); shorter ones go whole.
        pd_max_prefill_in_flight: a prefill replica with this many streams open is not used
            (the request goes whole): Dynamo's "remote prefill only when the prefill queue is
            short". 0 = no bound.
    """

    replicas: str = ""
    discovery_name: str = ""
    discovery_scheduler_port: int = 50051
    discovery_kvm_port: int = 50052
    discovery_offload_port: int = 0
    discovery_interval_seconds: float = 5.0
    policy: str = "kv_aware"
    prefill_weight: float = 1.0
    request_weight: float = 4.0
    kv_usage_weight: float = 8.0
    offload_weight_dram: float = 0.5
    offload_weight_disk: float = 0.3
    offload_weight_remote: float = 0.3
    predict_seconds: float = 10.0
    deployment_key: str = "kvmesh-dev"
    model_dir: str = ""
    health_interval_seconds: float = 1.0
    rpc_timeout_seconds: float = 10.0
    reconnect_min_seconds: float = 0.1
    reconnect_max_seconds: float = 5.0
    ready_timeout_seconds: float = 60.0
    pd_threshold_tokens: int = 256
    pd_max_prefill_in_flight: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"KVMESH_ROUTER_POLICY must be one of {POLICIES}, got {self.policy!r}")
        if min(self.prefill_weight, self.request_weight, self.kv_usage_weight, self.predict_seconds) < 0:
            raise ValueError("router weights and KVMESH_ROUTER_PREDICT_SECONDS must be >= 0")
        if not all(0 <= w <= 1 for w in (self.offload_weight_dram, self.offload_weight_disk,
                                         self.offload_weight_remote)):
            raise ValueError("KVMESH_ROUTER_OFFLOAD_WEIGHT_DRAM, _DISK and _REMOTE must be within 0..1")
        if self.health_interval_seconds <= 0 or self.reconnect_min_seconds <= 0:
            raise ValueError("router intervals must be positive")
        self.replica_addresses()  # fail at start on a malformed list
        if self.discovery_name and self.replicas:
            raise ValueError("set KVMESH_ROUTER_REPLICAS or KVMESH_ROUTER_DISCOVERY_NAME, not both")
        if self.pd_threshold_tokens < 0 or self.pd_max_prefill_in_flight < 0:
            raise ValueError("KVMESH_ROUTER_PD_THRESHOLD_TOKENS and _PD_MAX_PREFILL_IN_FLIGHT must be >= 0")
        if self.discovery_interval_seconds <= 0:
            raise ValueError("KVMESH_ROUTER_DISCOVERY_INTERVAL_SECONDS must be positive")
        for port in (self.discovery_scheduler_port, self.discovery_kvm_port):
            if not 0 < port < 65536:
                raise ValueError(f"router discovery port {port} out of range")
        if not 0 <= self.discovery_offload_port < 65536:
            raise ValueError(f"router discovery port {self.discovery_offload_port} out of range")

    def discovery_target(self) -> DiscoveryTarget | None:
        """What to resolve for replicas; None with a static ``replicas`` list."""
        if not self.discovery_name:
            return None
        return DiscoveryTarget(self.discovery_name, self.discovery_scheduler_port, self.discovery_kvm_port,
                               self.discovery_offload_port)

    def replica_addresses(self) -> tuple[ReplicaAddress, ...]:
        """The parsed replica list; raises ValueError naming the bad entry."""
        out: list[ReplicaAddress] = []
        for i, raw in enumerate(e.strip() for e in self.replicas.split(",")):
            if not raw:
                continue
            rid, sep, rest = raw.rpartition("=")
            parts = rest.split("/")
            if not 2 <= len(parts) <= 4 or not all(parts):
                raise ValueError(f"KVMESH_ROUTER_REPLICAS entry {raw!r}: expected "
                                 "id=scheduler/kv_cache_manager[/role][/offload_store]")
            extra = parts[2:]
            role = extra.pop(0) if extra and ":" not in extra[0] else "mixed"
            offload = extra.pop(0) if extra and ":" in extra[0] else ""
            if role not in ROLES or extra:
                raise ValueError(f"KVMESH_ROUTER_REPLICAS entry {raw!r}: role must be one of {ROLES} (expected "
                                 "id=scheduler/kv_cache_manager[/role][/offload_store_host:port])")
            out.append(ReplicaAddress(rid if sep else f"r{i}", parts[0], parts[1], role, offload))
        if len({r.id for r in out}) != len(out):
            raise ValueError("KVMESH_ROUTER_REPLICAS: replica ids must be unique")
        return tuple(out)
