"""The scheduler's readiness follows its dependencies (issue 12, item 5), with real gRPC servers
standing as the dependencies and real health probes: a required one down makes the server
NOT_SERVING (liveness unaffected) and SERVING again once it is back on its port; the optional
offload-store only shows under its own health name."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.readiness import DEPENDENCY_HEALTH_PREFIX, DependencyWatcher
from shared.config import ServerConfig
from shared.grpc_server import LIVENESS_SERVICE, RunningServer, start_server
from shared.launcher import HealthProbe

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(server: RunningServer, name: str = "") -> int | None:
    """The health of ``name``; None while the name is unknown (not yet reported)."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
            return None
        status: int = resp.status
        return status


def _within(seconds: float, predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture()
def servers() -> Iterator[dict[str, RunningServer]]:
    running = {name: start_server(ServerConfig(port=0), []) for name in
               ("scheduler", "kv-cache-manager", "model-runner", "offload-store")}
    yield running
    for server in running.values():
        server.stop(0)


def test_readiness_follows_required_dependencies_both_ways(servers: dict[str, RunningServer]) -> None:
    sched = servers["scheduler"]
    deps = {n: s for n, s in servers.items() if n != "scheduler"}
    probes = {n: HealthProbe(f"127.0.0.1:{s.port}", 0.5) for n, s in deps.items()}
    watcher = DependencyWatcher(probes, ("kv-cache-manager", "model-runner"), sched.set_serving,
                                sched.set_status, 0.1).start()
    try:
        assert _within(3, lambda: _status(sched, DEPENDENCY_HEALTH_PREFIX + "model-runner") == SERVING)
        assert _status(sched) == SERVING
        # The runner goes away: NOT_SERVING within a bounded time; liveness stays.
        runner_port = deps["model-runner"].port
        deps["model-runner"].stop(0)
        assert _within(3, lambda: _status(sched) == NOT_SERVING)
        assert _status(sched, DEPENDENCY_HEALTH_PREFIX + "model-runner") == NOT_SERVING
        assert _status(sched, LIVENESS_SERVICE) == SERVING
        assert watcher.down == ("model-runner",)
        # A new runner on the same port: SERVING again.
        servers["model-runner"] = start_server(ServerConfig(port=runner_port), [])
        assert _within(5, lambda: _status(sched) == SERVING)
        assert watcher.down == ()
        # The offload-store is optional: down, it shows under its own name only.
        deps["offload-store"].stop(0)
        assert _within(3, lambda: _status(sched, DEPENDENCY_HEALTH_PREFIX + "offload-store") == NOT_SERVING)
        assert _status(sched) == SERVING
        # A dependency answering NOT_SERVING counts as down, as one that does not answer.
        deps["kv-cache-manager"].set_serving(False)
        assert _within(3, lambda: _status(sched) == NOT_SERVING)
        assert watcher.down == ("kv-cache-manager", "offload-store")
    finally:
        watcher.stop()
        for probe in probes.values():
            probe.close()


def test_readiness_stays_not_serving_once_the_server_drains(servers: dict[str, RunningServer]) -> None:
    sched = servers["scheduler"]
    seen: list[int | None] = []

    def drain(_grace: float) -> None:
        sched.set_serving(True)  # a watcher racing the shutdown cannot turn it back on
        seen.append(_status(sched))

    sched.stop(0, drain=drain)
    assert seen == [NOT_SERVING]
