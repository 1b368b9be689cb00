"""Process lifecycle of the suite (issue 12, items 2, 5 and 8), with real processes on loopback:

- ``kvmesh up`` stopped during start-up leaves no child running;
- a second ``kvmesh up`` (or any service) on a port in use fails at start, in one line;
- SIGTERM to the scheduler with requests in flight: NOT_SERVING first, new calls refused, every
  stream ends with a final chunk, nothing stays live in the kv-cache-manager, exit 0, and the
  supervisor's replacement scheduler comes up and serves;
- a killed model-runner turns the scheduler's readiness NOT_SERVING (liveness stays SERVING),
  the supervisor restarts it on its port, and readiness comes back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.grpc_server import LIVENESS_SERVICE
from shared.launcher import ServiceProcess, ServiceStartError
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2, kv_cache_manager_pb2_grpc, scheduler_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ENV = {
    "KVMESH_RUNNER_BLOCK_SIZE": "4",
    "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(128 * 2048),
    "KVMESH_RUNNER_WARMUP": "0",
    "KVMESH_SCHED_MAX_NUM_BATCHED_TOKENS": "96",
    "KVMESH_GRACE_SECONDS": "3",
    "KVMESH_SCHED_DEPENDENCY_CHECK_SECONDS": "0.5",
}
STREAM_DEADLINE = 240.0  # well past any wait below, under pytest-timeout's 300 s


def _up_cmd(model_dir: Path, port: int, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--port", str(port),
            "--no-offload", "--log-dir", str(log_dir)]


def _health(address: str, service: str = "", channel: grpc.Channel | None = None) -> int | None:
    """The health status at ``address``, or None when it does not answer."""
    own = channel is None
    channel = channel or grpc.insecure_channel(address)
    try:
        status: int = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status
        return status
    except grpc.RpcError:
        return None
    finally:
        if own:
            channel.close()


def _log_tail(suite: Suite) -> str:
    """The scheduler's last log lines, for an assertion's message: a failure on a CI host is
    diagnosed from them."""
    return "scheduler log:\n" + "\n".join(suite.services["scheduler"].log_tail(6_000).splitlines()[-30:])


def _wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Polls ``predicate`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_up_stopped_during_start_up_leaves_no_child(tiny_llama_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(_up_cmd(tiny_llama_dir, 0, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    children: list[psutil.Process] = []
    try:
        # The kv-cache-manager is up and the model-runner is starting: SIGTERM now.
        _wait_for(lambda: (tmp_path / "kv-cache-manager.port").exists(), 60, "the kv-cache-manager's port file")
        _wait_for(lambda: len(psutil.Process(proc.pid).children()) >= 2, 30, "the model-runner child")
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], f"children left running: {alive}"
        assert proc.returncode == 0, err
        assert "kvmesh: stopped during start-up" in out
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=False,
                          log_dir=str(tmp_path_factory.mktemp("lifecycle-logs")), extra_env=ENV))
    yield s
    s.stop()


def test_a_port_in_use_fails_at_start_in_one_line(suite: Suite, tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = suite.services["scheduler"].port
    second = subprocess.Popen(_up_cmd(tiny_llama_dir, port, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGKILL)  # it came up on the shared port: the bug
        second.communicate()
        raise AssertionError("a second kvmesh up started on a port in use") from None
    assert second.returncode == 1
    assert err == f"kvmesh: port {port} on 127.0.0.1 is already in use\n"
    assert "suite up" not in out and not list(tmp_path.glob("*.port"))
    # Any service given a port in use exits at start with that one line, no traceback.
    with pytest.raises(ServiceStartError) as info:
        ServiceProcess("kv-cache-manager", port=port, startup_timeout=60, log_dir=str(tmp_path))
    assert f"kvmesh kv-cache-manager: port {port} on 127.0.0.1 is already in use" in str(info.value)
    assert "Traceback" not in str(info.value)
    assert _health(suite.address) == SERVING  # the running suite is untouched


def test_malformed_bytes_get_invalid_argument_and_one_log_line(suite: Suite) -> None:
    for name, method in [("scheduler", "/kvmesh.v1.Scheduler/Generate"),
                         ("kv-cache-manager", "/kvmesh.v1.KVCacheManager/AllocateSlots")]:
        proc = suite.services[name]
        with grpc.insecure_channel(proc.address) as channel, pytest.raises(grpc.RpcError) as info:
            if name == "scheduler":  # server-streaming
                list(channel.unary_stream(method)(b"\xff\xff\xff", timeout=10))
            else:
                channel.unary_unary(method)(b"\xff\xff\xff", timeout=10)
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid protobuf message for this method"), name
        lines = [ln for ln in proc.log_tail(50_000).splitlines() if method in ln or "Traceback" in ln]
        assert len(lines) == 1 and "malformed request message (3 bytes)" in lines[0], (name, lines)


def _kv_stats(suite: Suite) -> kv_cache_manager_pb2.KVCacheStats:
    channel = grpc.insecure_channel(suite.services["kv-cache-manager"].address)
    stub = kv_cache_manager_pb2_grpc.KVCacheManagerStub(channel)
    stub.CheckIntegrity(kv_cache_manager_pb2.CheckIntegrityRequest(), timeout=5)
    stats: kv_cache_manager_pb2.KVCacheStats = stub.GetStats(kv_cache_manager_pb2.GetStatsRequest(), timeout=5)
    return stats


def test_every_service_froze_its_start_up_heap(suite: Suite) -> None:
    """``serve_forever`` froze each service's start-up heap (``shared/gc_heap.py``) before serving:
    the log says how many objects its collector's full passes no longer walk."""
    for name, service in suite.services.items():
        counts = [int(m.group(1)) for m in re.finditer(r"(\d+) start-up objects frozen", service.log_tail(200_000))]
        assert len(counts) == 1, (name, counts)
        assert counts[0] > 10_000, (name, counts)  # the modules alone are tens of thousands of objects


def test_sigterm_drains_the_scheduler_and_frees_everything(suite: Suite) -> None:
    sched = suite.services["scheduler"]
    address = sched.address
    outcomes: dict[int, Any] = {}
    first_chunk = [threading.Event() for _ in range(8)]

    def stream(i: int) -> None:
        prompt = [5 + i, *range(10, 30)]
        try:
            with KVMeshClient(address) as client:
                # NOTE: a deadline far past the drain: the test is about the order of events, and on a
                # loaded CI host the first step and the signal can each take many seconds.
                for chunk in client.generate(prompt, 480, timeout=STREAM_DEADLINE, ignore_eos=True):
                    first_chunk[i].set()
                    if chunk.HasField("final"):
                        outcomes[i] = (chunk.final.finish_reason, chunk.final.stop_reason)
        except grpc.RpcError as exc:
            outcomes[i] = exc.code()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert first_chunk[0].wait(60)
    assert _kv_stats(suite).num_requests > 0
    channel = grpc.insecure_channel(address)  # connected before the signal: each check is quick
    assert _health(address, channel=channel) == SERVING
    sched.proc.send_signal(signal.SIGTERM)
    # Health goes NOT_SERVING first (liveness too: the process is going), then new calls are refused.
    # The order is the contract, not the delay: on a loaded 2-core machine the signal reached the
    # scheduler's main thread (8 streams decoding beside it) after more than 3 s once.
    _wait_for(lambda: _health(address, channel=channel) == NOT_SERVING, 15, "NOT_SERVING")
    assert _health(address, LIVENESS_SERVICE, channel=channel) == NOT_SERVING
    with KVMeshClient(address) as client, pytest.raises(grpc.RpcError) as info:
        client.complete([7, 8, 9], 2)
    channel.close()
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another instance")
    assert sched.proc.wait(20) == 0
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a client hangs"
    # Every stream ended with a final chunk: finished in the grace period, or ended by the drain.
    shutdown = (scheduler_pb2.FINISH_REASON_ABORT, "server shutting down")
    assert sorted(outcomes) == list(range(8)), (outcomes, _log_tail(suite))
    assert all(o in (shutdown, (scheduler_pb2.FINISH_REASON_LENGTH, "")) for o in outcomes.values()), (
        outcomes, _log_tail(suite))
    assert shutdown in outcomes.values()
    stats = _kv_stats(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
    # The supervisor's replacement comes up (nothing live blocks it) and serves.
    _wait_for(lambda: suite.restarts["scheduler"] == 1 and _health(address) == SERVING, 90, "a new scheduler")
    with KVMeshClient(address) as client:
        _, ids, final = client.complete([7, 8, 9], 3, ignore_eos=True)
    assert len(ids) == 3 and final.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH


def test_a_dead_runner_makes_the_scheduler_unready_until_it_is_restarted(suite: Suite) -> None:
    address = suite.address
    _wait_for(lambda: _health(address) == SERVING, 60, "a SERVING scheduler")
    runner = suite.services["model-runner"]
    restarts = suite.restarts["model-runner"]
    # A stream in flight when the runner dies: a clean status, the details in the scheduler's log.
    with KVMeshClient(address) as client:
        stream = client.generate(list(range(10, 30)), 400, timeout=STREAM_DEADLINE, ignore_eos=True,
                                 request_id="victim-1")
        next(stream)
        runner.proc.kill()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "model-runner unavailable; request victim-1 failed, retry"), _log_tail(suite)
    (line,) = [ln for ln in suite.services["scheduler"].log_tail(50_000).splitlines() if "victim-1" in ln]
    assert "model-runner step" in line and "failed for requests ['victim-1']" in line
    assert "StatusCode.UNAVAILABLE" in line  # the exception itself, on one line
    took = _wait_for(lambda: _health(address) == NOT_SERVING, 5, "NOT_SERVING after the runner died")
    assert took < 5
    assert _health(address, LIVENESS_SERVICE) == SERVING  # unready, not dead: no restart of the scheduler
    _wait_for(lambda: suite.restarts["model-runner"] == restarts + 1, 90, "the runner restarted")
    assert suite.services["model-runner"].address == runner.address
    _wait_for(lambda: _health(address) == SERVING, 30, "SERVING again")


def _listening_socket() -> tuple[Any, int]:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, int(sock.getsockname()[1])


@pytest.mark.parametrize("service", ["kv-cache-manager", "offload-store"])
def test_a_taken_metrics_port_fails_the_start_in_one_line(service: str, tmp_path: Path) -> None:
    """Found running the suite with KVMESH_METRICS_PORT on a port another process held: the
    kv-cache-manager reported its gRPC port, then died on the metrics bind with a traceback, and
    ``kvmesh up`` polled the dead address for its whole 300 s start-up timeout."""
    sock, port = _listening_socket()
    env = {"KVMESH_METRICS_PORT": str(port), "KVMESH_OFFLOAD_DATA_DIR": str(tmp_path / "data")}
    try:
        with pytest.raises(ServiceStartError) as info:
            ServiceProcess(service, env=env, startup_timeout=60, log_dir=str(tmp_path))
    finally:
        sock.close()
    message = str(info.value)
    assert message.startswith(f"{service} exited with 1:")
    assert f"kvmesh {service}: metrics port {port} on 127.0.0.1 is already in use" in message
    assert "Traceback" not in message
    assert not (tmp_path / f"{service}.port").exists()  # it failed before it reported a gRPC port


def test_the_health_wait_stops_when_the_process_has_exited() -> None:
    """A child that dies after reporting its port ends the launcher's wait at once: no answer can come."""
    from shared.launcher import wait_healthy, wait_http_healthy

    sock, port = _listening_socket()  # holds the port: nothing else answers there
    try:
        for wait in (lambda exited: wait_healthy(f"127.0.0.1:{port}", 600, exited=exited),
                     lambda exited: wait_http_healthy(f"127.0.0.1:{port}", 600, exited=exited)):
            calls: list[int] = []

            def exited(calls: list[int] = calls) -> bool:
                calls.append(1)
                return len(calls) >= 3  # alive for two polls, then gone

            with pytest.raises(ServiceStartError, match=f"127.0.0.1:{port}: the process exited"):
                wait(exited)
            assert len(calls) == 3
    finally:
        sock.close()
