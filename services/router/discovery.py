"""Replica discovery through DNS: a headless Service's A/AAAA records are the replicas.

A headless Service (``clusterIP: None``) answers its name with one record per ready pod, so
resolving it periodically is all the router needs to follow a Deployment scaled up and down:
no Kubernetes API access, no extra RBAC, and it works the same with compose's DNS. Each address
is one replica: its scheduler and its kv-cache-manager are two ports of the same pod.

This module only resolves and diffs (no grpc): :class:`services.router.client.ReplicaSet` applies
the diff. A vanished address is dropped only once its replica fails health, because a pod that
turned unready leaves the DNS answer before it stops serving the streams it has open (and a
DNS blip must not empty the mesh); a failed resolution changes nothing.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.router.types import ReplicaAddress

log = logging.getLogger(__name__)
# socket.getaddrinfo's signature as the discovery calls it: (host, port, family, type) -> records.
GetAddrInfo = Callable[..., Sequence[tuple[Any, ...]]]


@dataclass(frozen=True)
class DiscoveryTarget:
    """What to resolve and which ports of each address are the replica's two services.

    Attributes:
        name: the headless Service's DNS name (e.g. ``engine`` or ``engine.kvmesh.svc``).
        scheduler_port: each replica's scheduler port (what clients' requests are forwarded to).
        kvm_port: each replica's kv-cache-manager port (events and stats).
        offload_port: each replica's offload-store port (tier events); 0: not followed.
    """

    name: str
    scheduler_port: int
    kvm_port: int
    offload_port: int = 0


@dataclass(frozen=True)
class DiscoveryDiff:
    """What one resolution changes: replicas to add, replica ids to drop."""

    added: tuple[ReplicaAddress, ...] = ()
    removed: tuple[str, ...] = ()


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def replica_for(ip: str, target: DiscoveryTarget) -> ReplicaAddress:
    """The replica at ``ip``: its id is the address itself (stable for the pod's life, unique)."""
    offload = _hostport(ip, target.offload_port) if target.offload_port else ""
    return ReplicaAddress(ip, _hostport(ip, target.scheduler_port), _hostport(ip, target.kvm_port),
                          offload_address=offload)


def resolve(target: DiscoveryTarget, getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> frozenset[str] | None:
    """The addresses ``target.name`` resolves to now (A and AAAA); None when resolution fails."""
    try:
        records = getaddrinfo(target.name, target.scheduler_port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as exc:  # socket.gaierror: NXDOMAIN while no pod is ready, a DNS outage, ...
        log.warning("router: cannot resolve %s: %s", target.name, exc)
        return None
    return frozenset(str(sockaddr[0]).split("%", 1)[0] for _family, _type, _proto, _canon, sockaddr in records)


def diff(resolved: frozenset[str] | None, known: Collection[str], healthy: Iterable[str],
         target: DiscoveryTarget) -> DiscoveryDiff:
    """New addresses to add; known ones missing from the answer AND unhealthy to drop.

    ``known`` and ``healthy`` are replica ids (= addresses) the router holds now. A failed
    resolution (None) adds and drops nothing.
    """
    if resolved is None:
        return DiscoveryDiff()
    healthy_ids = set(healthy)
    added = tuple(replica_for(ip, target) for ip in sorted(resolved - set(known)))
    removed = tuple(sorted(r for r in known if r not in resolved and r not in healthy_ids))
    return DiscoveryDiff(added, removed)
