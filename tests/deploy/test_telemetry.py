"""Tracing: one call across two "services" is one trace; with tracing off nothing is installed.

The servers and clients are real gRPC objects on loopback inside this process; each side has its
own tracer provider and in-memory exporter, as two processes would.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    DEFAULT_ON,
    ParentBasedTraceIdRatio,
    TraceIdRatioBased,
)

from shared.config import ServerConfig
from shared.errors import Unavailable
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.span_attributes import safe_attributes, set_attributes
from shared.telemetry import (
    instrument_grpc_client,
    sampler_from_env,
    server_interceptors,
    setup_tracing,
)


def _provider(service: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture
def traced_health_server() -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    provider, exporter = _provider("kv-cache-manager")
    running = start_server(ServerConfig(port=0), [],
                           interceptors=server_interceptors(provider, trace_health_checks=True))
    yield running, exporter
    running.stop(grace=0)


def test_client_and_server_spans_share_one_trace(traced_health_server: Any) -> None:
    running, server_exporter = traced_health_server
    client_provider, client_exporter = _provider("scheduler")
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as raw:
        channel = instrument_grpc_client(raw, client_provider, trace_health_checks=True)
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    client_spans: tuple[ReadableSpan, ...] = client_exporter.get_finished_spans()
    server_spans: tuple[ReadableSpan, ...] = server_exporter.get_finished_spans()
    assert [s.kind for s in client_spans] == [trace.SpanKind.CLIENT]
    assert [s.kind for s in server_spans] == [trace.SpanKind.SERVER]
    client, server = client_spans[0], server_spans[0]
    assert client.context is not None and server.context is not None
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.is_remote
    assert server.parent.span_id == client.context.span_id
    assert server.name == "/grpc.health.v1.Health/Check"
    assert client.resource.attributes["service.name"] == "scheduler"
    assert server.resource.attributes["service.name"] == "kv-cache-manager"


def test_health_checks_are_not_traced_by_default() -> None:
    provider, exporter = _provider("kv-cache-manager")
    running = start_server(ServerConfig(port=0), [], interceptors=server_interceptors(provider))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as raw:
            channel = instrument_grpc_client(raw, provider)
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        running.stop(grace=0)
    assert exporter.get_finished_spans() == ()


def _fail(request: Any, context: grpc.ServicerContext) -> Any:
    raise Unavailable("model-runner is restarting")


def _add_failing_service(_servicer: Any, server: grpc.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        _fail, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
    generic = grpc.method_handlers_generic_handler("test.Failing", {"Fail": handler})
    server.add_generic_rpc_handlers((generic,))


def test_server_span_records_the_mapped_error_status() -> None:
    provider, exporter = _provider("kv-cache-manager")
    reg = ServiceRegistration("test.Failing", None, _add_failing_service)
    running = start_server(ServerConfig(port=0), [reg], interceptors=server_interceptors(provider))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = channel.unary_unary(
                "/test.Failing/Fail", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                call(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(grace=0)
    (server,) = exporter.get_finished_spans()
    assert server.status.status_code == trace.StatusCode.ERROR
    assert server.attributes is not None
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"},
    {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
    {"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"},
])
def test_tracing_off_installs_nothing(env: dict[str, str]) -> None:
    before = trace.get_tracer_provider()
    assert setup_tracing("scheduler", env) is None
    assert trace.get_tracer_provider() is before
    assert server_interceptors() == []
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        assert instrument_grpc_client(channel) is channel
    with trace.get_tracer("kvmesh").start_as_current_span("step") as current:
        set_attributes(current, {"kvmesh.batch_size": 3})
        assert not current.is_recording()


def test_console_exporter_names_the_service() -> None:
    provider = setup_tracing("offload-store", {"OTEL_TRACES_EXPORTER": "console"}, set_global=False)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "offload-store"
        assert provider.resource.attributes["service.namespace"] == "kvmesh"
    finally:
        provider.shutdown()


def test_endpoint_alone_enables_otlp_and_service_name_can_be_overridden() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SERVICE_NAME": "runner-0"}
    provider = setup_tracing("model-runner", env, set_global=False)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "runner-0"
    finally:
        provider.shutdown()


@pytest.mark.parametrize("env", [
    {"OTEL_TRACES_EXPORTER": "jaeger"},
    {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
])
def test_unsupported_exporter_settings_fail_loudly(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        setup_tracing("scheduler", env, set_global=False)


def test_sampler_follows_the_sdk_names() -> None:
    assert sampler_from_env({}) is DEFAULT_ON
    assert sampler_from_env({"OTEL_TRACES_SAMPLER": "always_off"}) is ALWAYS_OFF
    ratio = sampler_from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert isinstance(ratio, TraceIdRatioBased) and ratio.rate == 0.25
    parent = sampler_from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                               "OTEL_TRACES_SAMPLER_ARG": "x"})
    assert isinstance(parent, ParentBasedTraceIdRatio)


def test_setup_installs_the_global_provider_and_hooks() -> None:
    # A fresh interpreter: the global provider can be set only once per process.
    code = (
        "import grpc\n"
        "from opentelemetry import trace\n"
        "from shared.telemetry import setup_tracing, server_interceptors, instrument_grpc_client\n"
        "p = setup_tracing('scheduler', {'OTEL_TRACES_EXPORTER': 'console'})\n"
        "assert p is not None and trace.get_tracer_provider() is p\n"
        "assert len(server_interceptors()) == 1\n"
        "ch = grpc.insecure_channel('127.0.0.1:1')\n"
        "assert instrument_grpc_client(ch) is not ch\n"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=repo)


def test_attributes_never_carry_text_token_ids_or_salts() -> None:
    attrs = safe_attributes({
        "kvmesh.request_id": "req-1",
        "kvmesh.prompt": "The capital of France is",
        "kvmesh.prompt_token_ids": [1, 2, 3],
        "kvmesh.cache_salt": "tenant-secret",
        "kvmesh.salt_bytes": b"\x00\x01",
        "kvmesh.num_prompt_tokens": 5,
        "kvmesh.preempted": False,
        "gen_ai.request.model": "SmolLM2-135M-Instruct",
        "kvmesh.nothing": None,
    })
    assert attrs == {
        "kvmesh.request_id": "req-1",
        "kvmesh.num_prompt_tokens": 5,
        "kvmesh.preempted": False,
        "gen_ai.request.model": "SmolLM2-135M-Instruct",
    }


def test_internal_span_gets_only_safe_attributes() -> None:
    provider, exporter = _provider("scheduler")
    with provider.get_tracer("t").start_as_current_span("scheduler.step") as current:
        set_attributes(current, {"kvmesh.num_scheduled": 4, "kvmesh.prompt": "secret"})
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"kvmesh.num_scheduled": 4}


def _unfiltered_span_attributes(source: str) -> list[int]:
    """Lines of ``source`` that put attributes on a span without :func:`safe_attributes`: an
    ``attributes=`` argument that is not a ``safe_attributes(...)`` call, or a span's own
    ``.set_attribute(s)`` method (the filtered way is the function ``set_attributes(span, ...)``)."""
    def filtered(node: ast.expr) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "safe_attributes"

    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if method in ("set_attribute", "set_attributes") or any(
                k.arg == "attributes" and not filtered(k.value) for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_every_span_attribute_in_services_is_filtered() -> None:
    root = Path(__file__).resolve().parents[2]
    found = [f"{p.relative_to(root)}:{line}" for p in sorted((root / "services").rglob("*.py"))
             for line in _unfiltered_span_attributes(p.read_text())]
    assert not found, f"span attributes must pass shared.span_attributes.safe_attributes: {found}"


def test_the_span_attribute_guard_sees_each_way() -> None:
    source = ("span.set_attributes({'a': 1})\nspan.set_attribute('a', 1)\n"
              "tracer.start_span('s', attributes={'a': 1})\n"
              "tracer.start_span('s', attributes=safe_attributes({'a': 1}))\nset_attributes(span, {'a': 1})\n")
    assert _unfiltered_span_attributes(source) == [1, 2, 3]
