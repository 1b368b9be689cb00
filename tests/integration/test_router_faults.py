"""The router's fault rules over real gRPC, no model: the router's servicers in-process in front of
two scripted scheduler servers (each with a real kv-cache-manager server for events and stats).

The scripted schedulers are the router's peers, not the code under test: each answers Generate
as told (stream tokens, refuse with RESOURCE_EXHAUSTED, fail after the first token) and counts
its calls, so the tests see exactly which replica the router tried, in which order, how often.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from services.router.client import ReplicaSet
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.routing import Router
from services.router.servicer import RouterFront, RouterSchedulerServicer
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.metrics import new_registry
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.test_router_events import KVM, serve_kvm


@dataclass
class Scripted(scheduler_pb2_grpc.SchedulerServicer):
    mode: str = "ok"  # ok | refuse | fail_after_first
    calls: int = 0
    seen_auth: list[str] = field(default_factory=list)

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[scheduler_pb2.GenerateResponse]:
        self.calls += 1
        self.seen_auth.append(dict(context.invocation_metadata()).get("authorization", ""))
        if self.mode == "refuse":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue full")
        yield scheduler_pb2.GenerateResponse(token_ids=[7])
        if self.mode == "fail_after_first":
            context.abort(grpc.StatusCode.UNAVAILABLE, "runner crashed")
        yield scheduler_pb2.GenerateResponse(token_ids=[8])

    def GetModelInfo(self, request: scheduler_pb2.SchedulerModelInfoRequest, context: grpc.ServicerContext
                     ) -> scheduler_pb2.SchedulerModelInfo:
        return scheduler_pb2.SchedulerModelInfo(model_id="test-model", block_size=4)


@dataclass
class Peer:
    scripted: Scripted
    server: RunningServer
    kvm: KVM


@dataclass
class Setup:
    peers: list[Peer]
    router: RunningServer
    replicas: ReplicaSet
    registry: object

    def generate(self) -> tuple[list[int], grpc.RpcError | None]:
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{self.router.port}"))
        req = scheduler_pb2.GenerateRequest(max_tokens=2, token_ids=common_pb2.TokenIds(ids=list(range(20))))
        tokens: list[int] = []
        try:
            for msg in stub.Generate(req, metadata=(("authorization", "Bearer sk-caller"),), timeout=10):
                tokens.extend(msg.token_ids)
        except grpc.RpcError as exc:
            return tokens, exc
        return tokens, None

    def retries(self, reason: str) -> float:
        return self.registry.get_sample_value("kvmesh:router_retries_total", {"reason": reason}) or 0.0  # type: ignore[attr-defined]


@pytest.fixture()
def setup() -> Iterator[Setup]:
    with serving(predict_seconds=0) as s:
        yield s


@contextlib.contextmanager
def serving(predict_seconds: float) -> Iterator[Setup]:
    peers = []
    for _ in range(2):
        scripted = Scripted()
        server = start_server(ServerConfig(port=0), [ServiceRegistration(
            "kvmesh.v1.Scheduler", scripted, scheduler_pb2_grpc.add_SchedulerServicer_to_server)])
        peers.append(Peer(scripted, server, serve_kvm()))
    replicas_cfg = ",".join(f"r{i}=127.0.0.1:{p.server.port}/127.0.0.1:{p.kvm.server.port}"
                            for i, p in enumerate(peers))
    # Probes once an hour: a replica that dies stays "healthy" until a forward finds out. No
    # predictions: the scripted schedulers store nothing, and the tests count on the tie rotation
    # for the same prompt sent again (predictions would send it after the first one).
    cfg = RouterConfig(replicas=replicas_cfg, deployment_key="test-key", health_interval_seconds=3600,
                       predict_seconds=predict_seconds)
    registry = new_registry(process_collectors=False)
    metrics = RouterMetrics(registry)
    index = PrefixIndex()
    replicas = ReplicaSet(cfg, index, metrics)
    replicas.start()
    assert replicas.wait_ready(10)
    front = RouterFront(replicas, Router(cfg, index, metrics), None)
    router = start_server(ServerConfig(port=0), [ServiceRegistration(
        "kvmesh.v1.Scheduler", RouterSchedulerServicer(front), scheduler_pb2_grpc.add_SchedulerServicer_to_server)])
    yield Setup(peers, router, replicas, registry)
    router.stop(0)
    replicas.close()
    for p in peers:
        p.server.stop(0)
        p.kvm.stop()


def test_a_stream_is_forwarded_with_the_callers_key(setup: Setup) -> None:
    tokens, err = setup.generate()
    assert (tokens, err) == ([7, 8], None)
    assert [p.scripted.seen_auth for p in setup.peers] in ([["Bearer sk-caller"], []], [[], ["Bearer sk-caller"]])


def test_every_candidate_refusing_is_resource_exhausted(setup: Setup) -> None:
    for p in setup.peers:
        p.scripted.mode = "refuse"
    tokens, err = setup.generate()
    assert tokens == [] and err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [p.scripted.calls for p in setup.peers] == [1, 1]
    assert setup.retries("refused") == 1.0
    assert all(r.healthy for r in setup.replicas.replicas)  # refusing is not being down


def test_one_refusal_moves_the_request_to_the_other(setup: Setup) -> None:
    setup.peers[0].scripted.mode = "refuse"
    # Two cold requests: the tie-break puts r0 first, then r1 first.
    assert setup.generate() == ([7, 8], None)
    assert setup.generate() == ([7, 8], None)
    assert [p.scripted.calls for p in setup.peers] == [1, 2]
    assert setup.retries("refused") == 1.0


def test_an_unreachable_replica_is_retried_once_on_the_other(setup: Setup) -> None:
    assert setup.generate() == setup.generate() == ([7, 8], None)  # turns 0 (r0 first) and 1 (r1 first)
    setup.peers[0].server.stop(0)  # r0 dies; the router's probe has not noticed
    assert setup.replicas.by_id["r0"].healthy
    for _ in range(3):  # turns 2 (r0 first), 3 (r1 first), 4 (r0 first, were it still a candidate)
        assert setup.generate() == ([7, 8], None)
    assert setup.retries("unavailable") == 1.0  # only turn 2 found r0 down, and marked it
    assert not setup.replicas.by_id["r0"].healthy
    assert [p.scripted.calls for p in setup.peers] == [1, 4]
    setup.peers[1].server.stop(0)
    tokens, err = setup.generate()  # r1 is the only candidate, and unreachable
    assert tokens == [] and err is not None and err.code() == grpc.StatusCode.UNAVAILABLE


def test_after_the_first_token_the_status_ends_the_stream_without_replay(setup: Setup) -> None:
    for p in setup.peers:
        p.scripted.mode = "fail_after_first"
    tokens, err = setup.generate()
    # UNAVAILABLE before the first token would be retried; after it, it is the caller's status.
    assert tokens == [7] and err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "runner crashed"
    assert sorted(p.scripted.calls for p in setup.peers) == [0, 1]
    assert setup.retries("unavailable") == setup.retries("refused") == 0.0


def test_a_refusal_moves_the_prediction_to_the_replica_that_served() -> None:
    """With predictions on, the same prompt again follows the first request, to where it was
    actually served: r0 refused it, so r1 (which then took it) is predicted, r0 is not."""
    with serving(predict_seconds=60) as s:
        s.peers[0].scripted.mode = "refuse"
        assert s.generate() == ([7, 8], None)  # turn 0: r0 first, refused, then r1
        s.peers[0].scripted.mode = "ok"
        for _ in range(3):  # ties would rotate r1, r0, r1 first: the prediction keeps r1 first
            assert s.generate() == ([7, 8], None)
        assert [p.scripted.calls for p in s.peers] == [1, 4]
        assert s.retries("refused") == 1.0
