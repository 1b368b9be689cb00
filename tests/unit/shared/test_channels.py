"""Message-size limits set on purpose on both ends (shared/channels.py, shared/grpc_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from shared.channels import MAX_MESSAGE_BYTES, open_channel
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


class _Echo(scheduler_pb2_grpc.SchedulerServicer):
    def Detokenize(self, request: Any, context: Any) -> Any:
        return scheduler_pb2.DetokenizeResponse(text="x" * len(request.token_ids))


@pytest.fixture()
def server() -> Iterator[RunningServer]:
    reg = ServiceRegistration("kvmesh.v1.Scheduler", _Echo(), scheduler_pb2_grpc.add_SchedulerServicer_to_server)
    running = start_server(ServerConfig(port=0, grace_seconds=0.5), [reg])
    yield running
    running.stop(0)


def test_messages_past_grpcs_4_mib_default_pass_both_ways(server: RunningServer) -> None:
    n = 1_500_000  # ~6 MB request (varint ids of 4 bytes) and a 1.5 MB reply
    with open_channel(f"127.0.0.1:{server.port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        reply = stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=[1 << 21] * n), timeout=30)
    assert len(reply.text) == n


def test_messages_past_the_limit_are_refused(server: RunningServer) -> None:
    n = MAX_MESSAGE_BYTES // 4 + 1024  # ids of 2**21 take 4 bytes each: just over 64 MiB
    with open_channel(f"127.0.0.1:{server.port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=[1 << 21] * n), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
