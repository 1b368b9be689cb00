"""The shared server helper: health, reflection, error mapping, graceful stop (in-process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.config import ServerConfig
from shared.errors import InvalidArgument, NotFound, ResourceExhausted
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


class _Tokenizer(scheduler_pb2_grpc.SchedulerServicer):
    """A tiny servicer whose behaviour is chosen by the input, to exercise the interceptor."""

    def Tokenize(self, request: Any, context: Any) -> Any:
        if request.text == "bad":
            raise InvalidArgument("text: bad")
        if request.text == "missing":
            raise NotFound("no such thing")
        if request.text == "crash":
            raise RuntimeError("boom")
        return scheduler_pb2.TokenizeResponse(token_ids=[len(request.text)])

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        yield scheduler_pb2.GenerateResponse(request_id="r", token_ids=[1])
        raise ResourceExhausted("queue full")


@pytest.fixture()
def server() -> Iterator[RunningServer]:
    reg = ServiceRegistration(
        "kvmesh.v1.Scheduler", _Tokenizer(), scheduler_pb2_grpc.add_SchedulerServicer_to_server
    )
    running = start_server(ServerConfig(port=0, grace_seconds=0.5), [reg])
    yield running
    running.stop(0)


def _stub(server: RunningServer) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def test_errors_map_to_status_codes(server: RunningServer) -> None:
    stub = _stub(server)
    assert list(stub.Tokenize(scheduler_pb2.TokenizeRequest(text="abc")).token_ids) == [3]
    for text, code in [("bad", grpc.StatusCode.INVALID_ARGUMENT), ("missing", grpc.StatusCode.NOT_FOUND),
                       ("crash", grpc.StatusCode.INTERNAL)]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(scheduler_pb2.TokenizeRequest(text=text))
        assert info.value.code() == code
    assert "boom" in str(info.value.details())


def test_stream_errors_map_after_partial_output(server: RunningServer) -> None:
    it = _stub(server).Generate(scheduler_pb2.GenerateRequest(text="x"))
    assert list(next(it).token_ids) == [1]
    with pytest.raises(grpc.RpcError) as info:
        next(it)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_and_reflection(server: RunningServer) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for name in ["", "kvmesh.v1.Scheduler"]:
        resp = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in next(answers).list_services_response.service}
    assert {"kvmesh.v1.Scheduler", "grpc.health.v1.Health"} <= names


def test_stop_marks_not_serving_then_refuses(server: RunningServer) -> None:
    server.stop(0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
