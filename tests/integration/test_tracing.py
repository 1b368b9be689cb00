"""One request is one trace across all four services.

The test runs its own OTLP/gRPC trace receiver, starts the suite as real processes exporting to
it, sends one request, and checks that the spans of the scheduler, kv-cache-manager, model-runner
and offload-store share one trace id and hang off each other correctly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    kind: int
    attributes: dict[str, Any]


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(
                            attrs.get("service.name", ""), s.name, s.trace_id, s.span_id, s.parent_span_id, s.kind,
                            {a.key: a.value for a in s.attributes}))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[_Receiver, int]]:
    rec = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


def test_one_request_is_one_trace_across_services(tiny_llama_dir: Path, tmp_path: Path,
                                                  receiver: tuple[_Receiver, int]) -> None:
    rec, port = receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_RUNNER_BLOCK_SIZE": "4",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(64 * 2048),
    }
    suite = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=True,
                              log_dir=str(tmp_path), extra_env=env))
    try:
        with KVMeshClient(suite.address) as client:
            _, ids, final = client.complete(list(range(3, 23)), 3, ignore_eos=True, request_id="traced-1")
        assert len(ids) == 3 and final.completion_tokens == 3
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with rec.lock:
                names = {(s.service, s.name) for s in rec.spans}
            if {("kv-cache-manager", "/kvmesh.v1.KVCacheManager/AllocateSlots"),
                ("model-runner", "/kvmesh.v1.ModelRunner/Execute"),
                ("offload-store", "/kvmesh.v1.OffloadStore/Lookup")} <= names:
                break
            time.sleep(0.1)
    finally:
        suite.stop()
    with rec.lock:
        spans = list(rec.spans)
    generate = [s for s in spans if s.service == "scheduler" and s.name == "/kvmesh.v1.Scheduler/Generate"]
    assert len(generate) == 1
    root = generate[0]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in trace}
    assert {s.service for s in trace} == {"scheduler", "kv-cache-manager", "model-runner", "offload-store"}

    steps = [s for s in trace if s.name == "scheduler.step"]
    assert steps and all(s.parent_id == root.span_id for s in steps)
    queue = [s for s in trace if s.name == "scheduler.queue"]
    assert len(queue) == 1 and queue[0].parent_id == root.span_id

    def chain(service: str, method: str) -> None:
        servers = [s for s in trace if s.service == service and s.name == method]
        assert servers, f"no {method} span in the trace"
        for srv in servers:
            client_span = by_id[srv.parent_id]  # the scheduler's CLIENT span of that RPC
            assert client_span.service == "scheduler" and client_span.name == method
            assert by_id[client_span.parent_id].name == "scheduler.step"

    chain("kv-cache-manager", "/kvmesh.v1.KVCacheManager/AllocateSlots")
    chain("model-runner", "/kvmesh.v1.ModelRunner/Execute")
    chain("offload-store", "/kvmesh.v1.OffloadStore/Lookup")
    # Attributes name the request but never carry prompt text or token ids.
    step_attrs = steps[0].attributes
    assert step_attrs["kvmesh.request_id"].string_value == "traced-1"
    for s in trace:
        assert not any("token_ids" in k or ("prompt" in k and "tokens" not in k) for k in s.attributes)
