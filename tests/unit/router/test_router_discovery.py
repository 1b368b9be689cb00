"""DNS replica discovery: what a resolution adds and drops, exactly, with an injected resolver."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from services.kv_cache_manager.types import BlockStored, KVEventBatch
from services.router.client import ReplicaSet
from services.router.config import RouterConfig
from services.router.discovery import DiscoveryDiff, DiscoveryTarget, diff, replica_for, resolve
from services.router.index import PrefixIndex
from services.router.types import ReplicaAddress
from shared.hashing import BlockHash
from shared.pb.kvmesh.v1 import scheduler_pb2

TARGET = DiscoveryTarget("engine", 50051, 50052)


class FakeDNS:
    """getaddrinfo over a table the test edits; records every query."""

    def __init__(self, answer: Sequence[str] = ()) -> None:
        self.answer: Sequence[str] | None = answer
        self.queries: list[tuple[str, int, int, int]] = []

    def __call__(self, host: str, port: int, family: int = 0, type: int = 0) -> list[tuple[Any, ...]]:
        self.queries.append((host, port, family, type))
        if self.answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out: list[tuple[Any, ...]] = []
        for ip in self.answer:
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)))
        return out


def test_resolve_returns_every_a_and_aaaa_address_once() -> None:
    dns = FakeDNS(["10.0.0.5", "10.0.0.5", "fd00::7%eth0", "10.0.0.6"])
    assert resolve(TARGET, dns) == frozenset({"10.0.0.5", "10.0.0.6", "fd00::7"})
    assert dns.queries == [("engine", 50051, socket.AF_UNSPEC, socket.SOCK_STREAM)]


def test_a_failed_resolution_is_none_and_changes_nothing() -> None:
    dns = FakeDNS()
    dns.answer = None
    assert resolve(TARGET, dns) is None
    assert diff(None, ["10.0.0.5"], [], TARGET) == DiscoveryDiff()


def test_replica_ids_are_addresses_and_ipv6_is_bracketed() -> None:
    assert replica_for("10.0.0.5", TARGET) == ReplicaAddress("10.0.0.5", "10.0.0.5:50051", "10.0.0.5:50052")
    assert replica_for("fd00::7", TARGET) == ReplicaAddress("fd00::7", "[fd00::7]:50051", "[fd00::7]:50052")


def test_diff_adds_new_and_drops_only_vanished_unhealthy_replicas() -> None:
    known = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    healthy = ["10.0.0.1", "10.0.0.2"]  # .3 failed its health check
    resolved = frozenset({"10.0.0.1", "10.0.0.4"})  # .2 and .3 left the answer, .4 is new
    change = diff(resolved, known, healthy, TARGET)
    # .2 vanished but still answers health (draining its streams): kept until it fails.
    assert change == DiscoveryDiff((ReplicaAddress("10.0.0.4", "10.0.0.4:50051", "10.0.0.4:50052"),),
                                   ("10.0.0.3",))
    assert diff(resolved, ["10.0.0.1", "10.0.0.4"], ["10.0.0.1", "10.0.0.4"], TARGET) == DiscoveryDiff()


def test_config_discovery_is_exclusive_with_a_static_list() -> None:
    assert RouterConfig(replicas="a=s:1/k:2").discovery_target() is None
    assert RouterConfig(discovery_name="engine.kvmesh.svc", discovery_scheduler_port=7,
                        discovery_kvm_port=8).discovery_target() == DiscoveryTarget("engine.kvmesh.svc", 7, 8)
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(replicas="a=s:1/k:2", discovery_name="engine")
    with pytest.raises(ValueError, match="out of range"):
        RouterConfig(discovery_name="engine", discovery_kvm_port=0)
    with pytest.raises(ValueError, match="INTERVAL"):
        RouterConfig(discovery_name="engine", discovery_interval_seconds=0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replica_set_follows_the_answer_and_forgets_a_dropped_replicas_blocks() -> None:
    """Real ReplicaSet and channels: the addresses refuse connections, so they fail health."""
    port = _closed_port()
    dns = FakeDNS(["127.0.0.1"])
    index = PrefixIndex()
    cfg = RouterConfig(discovery_name="engine", discovery_scheduler_port=port, discovery_kvm_port=port,
                       rpc_timeout_seconds=2.0, discovery_interval_seconds=3600)
    replicas = ReplicaSet(cfg, index, getaddrinfo=dns)
    try:
        assert replicas.replicas == []
        added = replicas.discover()
        assert [a.id for a in added.added] == ["127.0.0.1"] and added.removed == ()
        assert list(replicas.by_id) == ["127.0.0.1"]
        assert replicas.by_id["127.0.0.1"].address.scheduler_address == f"127.0.0.1:{port}"
        assert not replicas.by_id["127.0.0.1"].healthy  # its probe was refused
        h = BlockHash(b"\x01" * 32)
        assert index.apply("127.0.0.1", KVEventBatch(1, (BlockStored((h,), None, 4, 4, (0,)),)))
        assert index.num_blocks("127.0.0.1") == 1

        dns.answer = None  # DNS outage: nothing dropped
        assert replicas.discover() == DiscoveryDiff()
        assert list(replicas.by_id) == ["127.0.0.1"]

        dropped = replicas.by_id["127.0.0.1"]
        dns.answer = ["127.0.0.2"]
        change = replicas.discover()
        assert [a.id for a in change.added] == ["127.0.0.2"] and change.removed == ("127.0.0.1",)
        assert [r.id for r in replicas.replicas] == ["127.0.0.2"]
        assert index.num_blocks("127.0.0.1") == 0
        # A request that chose it just before the drop still gets a status (and would fail over).
        with pytest.raises(grpc.RpcError) as err:
            dropped.stub.Tokenize(scheduler_pb2.TokenizeRequest(text="x"), timeout=2.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        replicas.discover()  # the next round closes it
        with pytest.raises(ValueError, match="closed channel"):
            dropped.stub.Tokenize(scheduler_pb2.TokenizeRequest(text="x"), timeout=2.0)
        assert not replicas.wait_ready(0.1)
    finally:
        replicas.close()
