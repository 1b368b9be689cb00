"""The router core's API as frozen dataclasses (no protobuf, no grpc)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one replica is: its public scheduler and its kv-cache-manager (for events, stats).

    ``role``: ``mixed``, ``prefill`` or ``decode`` (docs/mesh.md, "Prefill/decode"): a ``prefill``
    replica only ever gets the first leg of a disaggregated request. ``offload_address``: its
    offload-store, whose tier events the router follows ("": none, the pool alone is scored).
    """

    id: str
    scheduler_address: str
    kvm_address: str
    role: str = "mixed"
    offload_address: str = ""


@dataclass(frozen=True)
class OffloadMatch:
    """Blocks past a replica's pool match that its offload-store would load, by tier."""

    dram: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        """Blocks the replica would load rather than compute."""
        return self.dram + self.disk + self.remote


@dataclass(frozen=True)
class ReplicaLoad:
    """What the scorer knows of a replica's load when it scores.

    Attributes:
        in_flight: Generate streams the router has open on it (known exactly, at once).
        kv_usage: share of its pool referenced by requests, 0..1 (from the last stats probe).
    """

    in_flight: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class ReplicaScore:
    """One candidate's score: the parts and their weighted sum (lower wins)."""

    replica_id: str
    matched_blocks: int  # in its pool
    cost: float
    in_flight: int
    kv_usage: float
    offload: OffloadMatch = OffloadMatch()  # past matched_blocks, in its offload tiers


@dataclass(frozen=True)
class Decision:
    """A routing decision: candidates best first (the first is the choice, the rest fallbacks)."""

    policy: str
    total_blocks: int
    scores: tuple[ReplicaScore, ...]
    hashes: tuple[bytes, ...] = field(default=(), repr=False)  # the request's block hashes

    @property
    def replica_id(self) -> str:
        """The chosen replica ('' when there was no candidate)."""
        return self.scores[0].replica_id if self.scores else ""

    @property
    def matched_blocks(self) -> int:
        """Blocks of the request the chosen replica holds in its pool."""
        return self.scores[0].matched_blocks if self.scores else 0

    @property
    def offload(self) -> OffloadMatch:
        """Blocks past that the chosen replica's offload-store would load."""
        return self.scores[0].offload if self.scores else OffloadMatch()
