"""The shared server helper: health, reflection, error mapping, graceful stop (in-process)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.config import ServerConfig
from shared.errors import InvalidArgument, NotFound, ResourceExhausted
from shared.grpc_server import LIVENESS_SERVICE, PortInUseError, RunningServer, ServiceRegistration, start_server
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
        if request.text == "downstream":  # a failed call to another service: its error names the peer
            health_pb2_grpc.HealthStub(grpc.insecure_channel("127.0.0.1:1")).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5)
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


def test_errors_map_to_status_codes(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    stub = _stub(server)
    assert list(stub.Tokenize(scheduler_pb2.TokenizeRequest(text="abc")).token_ids) == [3]
    for text, code in [("bad", grpc.StatusCode.INVALID_ARGUMENT), ("missing", grpc.StatusCode.NOT_FOUND),
                       ("crash", grpc.StatusCode.INTERNAL)]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(scheduler_pb2.TokenizeRequest(text=text))
        assert info.value.code() == code
    # An unexpected exception: the client gets an error id, never the exception's text (which can
    # name internal addresses); the log has the text under the same id.
    details = str(info.value.details())
    assert "boom" not in details and details.startswith("internal error (error id ")
    error_id = details.removeprefix("internal error (error id ").rstrip(")")
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])


def test_a_downstream_rpc_error_reaches_the_client_without_the_peer(server: RunningServer) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _stub(server).Tokenize(scheduler_pb2.TokenizeRequest(text="downstream"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = str(info.value.details())
    assert details.startswith("internal error (error id ") and "127.0.0.1" not in details


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


_RAW = b"\xff\xff\xff"  # field 31, wire type 7: no protobuf message parses this


@pytest.mark.parametrize("method,streaming", [
    ("/kvmesh.v1.Scheduler/Tokenize", False), ("/kvmesh.v1.Scheduler/Generate", True),
    ("/grpc.health.v1.Health/Check", False),
])
def test_malformed_bytes_are_invalid_argument_with_one_log_line(
        server: RunningServer, caplog: pytest.LogCaptureFixture, method: str, streaming: bool) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    with pytest.raises(grpc.RpcError) as info:
        if streaming:
            list(channel.unary_stream(method, request_serializer=None, response_deserializer=None)(_RAW, timeout=5))
        else:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(_RAW, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "request: not a valid protobuf message for this method"
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(logged) == 1 and logged[0].exc_info is None, [r.getMessage() for r in logged]
    assert method in logged[0].getMessage() and "3 bytes" in logged[0].getMessage()
    # The server goes on serving well-formed calls.
    assert list(_stub(server).Tokenize(scheduler_pb2.TokenizeRequest(text="ab")).token_ids) == [2]


def test_a_port_in_use_is_an_error_at_start(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = ServiceRegistration("kvmesh.v1.Scheduler", _Tokenizer(), scheduler_pb2_grpc.add_SchedulerServicer_to_server)
    with pytest.raises(PortInUseError, match=rf"^port {server.port} on 127.0.0.1 is already in use$"):
        start_server(ServerConfig(port=server.port), [reg])
    # Without the friendly pre-check, grpc's own bind must fail too (no SO_REUSEPORT sharing).
    monkeypatch.setattr("shared.grpc_server.check_port_free", lambda host, port: None)
    with pytest.raises(PortInUseError, match="could not bind"):
        start_server(ServerConfig(port=server.port), [reg])


def test_requests_above_the_receive_limit_are_refused() -> None:
    reg = ServiceRegistration("kvmesh.v1.Scheduler", _Tokenizer(), scheduler_pb2_grpc.add_SchedulerServicer_to_server)
    running = start_server(ServerConfig(port=0, max_receive_message_bytes=1024), [reg])
    try:
        stub = _stub(running)
        assert list(stub.Tokenize(scheduler_pb2.TokenizeRequest(text="a" * 900)).token_ids) == [900]
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(scheduler_pb2.TokenizeRequest(text="a" * 2000))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running.stop(0)


def _health(server: RunningServer, name: str = "") -> int:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
    status: int = resp.status
    return status


def test_set_serving_flips_readiness_but_not_liveness(server: RunningServer) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    server.set_serving(False)
    assert [_health(server, n) for n in ("", "kvmesh.v1.Scheduler", LIVENESS_SERVICE)] == [
        not_serving, not_serving, serving]
    server.set_serving(True)
    assert [_health(server, n) for n in ("", "kvmesh.v1.Scheduler", LIVENESS_SERVICE)] == [serving] * 3


class _Slow(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def Tokenize(self, request: Any, context: Any) -> Any:
        return scheduler_pb2.TokenizeResponse(token_ids=[1])

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self.started.set()
        self.release.wait(10)
        yield scheduler_pb2.GenerateResponse(request_id="slow", token_ids=[7])


def test_stop_goes_not_serving_then_refuses_new_calls_then_drains() -> None:
    slow = _Slow()
    reg = ServiceRegistration("kvmesh.v1.Scheduler", slow, scheduler_pb2_grpc.add_SchedulerServicer_to_server)
    running = start_server(ServerConfig(port=0, grace_seconds=5), [reg])
    stub = _stub(running)
    in_flight = stub.Generate(scheduler_pb2.GenerateRequest(text="x"), timeout=10)
    results: list[Any] = []
    reader = threading.Thread(target=lambda: results.extend(in_flight))
    reader.start()
    assert slow.started.wait(5)
    seen: dict[str, Any] = {}

    def drain(grace: float) -> None:
        seen["grace"] = grace
        seen["health"] = _health(running)
        seen["liveness"] = _health(running, LIVENESS_SERVICE)
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(scheduler_pb2.TokenizeRequest(text="new"), timeout=2)
        seen["new_call"] = info.value.code(), info.value.details()
        slow.release.set()  # the in-flight stream finishes within the grace
        reader.join(5)

    running.stop(drain=drain)
    assert seen == {"grace": 5, "health": health_pb2.HealthCheckResponse.NOT_SERVING,
                    "liveness": health_pb2.HealthCheckResponse.NOT_SERVING,
                    "new_call": (grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another instance")}
    assert [list(r.token_ids) for r in results] == [[7]]
