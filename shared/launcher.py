"""Starts kvmesh services as child processes and waits until they answer health checks.

Used by ``kvmesh up`` and by the integration tests, so both exercise the same start-up path:
``kvmesh serve <service>`` with the port passed as 0 and reported back through a port file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.channels import open_channel
from shared.config import from_env
from shared.tls import TLSFiles


class ServiceStartError(RuntimeError):
    """The service exited or did not become healthy in time; carries its log tail."""


def wait_healthy(address: str, timeout: float, service: str = "", tls: TLSFiles | None = None,
                 cancel: threading.Event | None = None, exited: Callable[[], bool] | None = None) -> None:
    """Polls ``grpc.health.v1`` at ``address`` until SERVING or ``timeout`` seconds pass.

    Args:
        exited: whether the process behind ``address`` has ended: then no answer can come, and
            the wait stops at once rather than at ``timeout``.

    Raises:
        ServiceStartError: ``cancel`` was set, or ``exited()`` became true, while waiting.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with open_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise ServiceStartError(f"{address}: start-up cancelled")
            if exited is not None and exited():
                raise ServiceStartError(f"{address}: the process exited")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    raise TimeoutError(f"{address} not healthy after {timeout}s: {last}")


class HealthProbe:
    """One ``grpc.health.v1`` check of ``address`` per call, on a channel kept open between calls.

    NOTE: the channel's short reconnect backoff (shared/channels.py) lets a restarted peer be seen
    within about a second.
    """

    def __init__(self, address: str, timeout: float, service: str = "") -> None:
        self.address = address
        self.timeout = timeout
        self._request = health_pb2.HealthCheckRequest(service=service)
        self._channel = open_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def __call__(self) -> bool:
        """Whether the peer answered SERVING within the timeout."""
        try:
            resp = self._stub.Check(self._request, timeout=self.timeout)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()


def wait_http_healthy(address: str, timeout: float, exited: Callable[[], bool] | None = None) -> None:
    """Polls ``GET http://address/health`` until it answers 200 (the gateway speaks HTTP, not gRPC);
    ``exited`` as :func:`wait_healthy`'s."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if exited is not None and exited():
            raise ServiceStartError(f"{address}: the process exited")
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{address} not healthy after {timeout}s: {last}")


# Services that answer "are you up?" over HTTP (``GET /health``); the others speak grpc.health.v1.
HTTP_SERVICES = frozenset({"gateway"})


class ServiceProcess:
    """One ``kvmesh serve <name>`` child process on an ephemeral loopback port.

    Args:
        name: service name as ``kvmesh serve`` knows it (e.g. ``kv-cache-manager``).
        env: extra environment variables (configuration) for the child.
        host: address to bind.
        port: port to bind; 0 picks a free one.
        startup_timeout: seconds to wait for the port file and a SERVING health answer.
        log_dir: folder of the log and port files; the log is appended to (a restarted service
            keeps its predecessor's lines).
        cancel: set by another thread (e.g. a signal handler) to abandon the start-up: the child
            is stopped and :class:`ServiceStartError` raised.
        cpus: the CPUs the child may run on: its affinity, set as soon as it exists, while its
            interpreter is still starting (CPython starts no thread of its own; every thread
            created later inherits the mask); empty: those of this process.
    """

    def __init__(self, name: str, env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                 port: int = 0, startup_timeout: float = 60.0, log_dir: str | None = None,
                 cancel: threading.Event | None = None, cpus: Sequence[int] = ()) -> None:
        self.name = name
        self.cpus = tuple(cpus)
        self.host = host
        self._cancel = cancel
        self.env = dict(env or {})
        self.started_at = time.monotonic()
        self._dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvmesh-{name}-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._dir / f"{name}.log"
        port_file = self._dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["KVMESH_HOST"] = host
        child_env["KVMESH_PORT"] = str(port)
        child_env["KVMESH_PORT_FILE"] = str(port_file)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", name],
            env=child_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        if self.cpus:
            os.sched_setaffinity(self.proc.pid, self.cpus)
        # NOTE: a child that reported its port and then died (e.g. a later bind failed) used to
        # leave the launcher polling a dead address until startup_timeout (300 s under `kvmesh up`).
        def exited() -> bool:
            return self.proc.poll() is not None

        try:
            self.port = self._wait_port(port_file, startup_timeout)
            try:
                if name in HTTP_SERVICES:
                    wait_http_healthy(self.address, startup_timeout, exited=exited)
                else:
                    # The child serves TLS when its environment names certificates: dial it the same way.
                    wait_healthy(self.address, startup_timeout,
                                 tls=from_env(TLSFiles, "KVMESH_TLS_", env=child_env), cancel=cancel, exited=exited)
            except ServiceStartError:
                if exited():
                    raise self._exited_error() from None
                raise
        except BaseException:
            self.stop(timeout=2.0)
            raise

    @property
    def address(self) -> str:
        """``host:port`` to dial."""
        return f"{self.host}:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the child's combined output."""
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def _exited_error(self) -> ServiceStartError:
        """The error for a child that ended during start-up: its exit code and its log's tail."""
        return ServiceStartError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def _wait_port(self, port_file: Path, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._cancel is not None and self._cancel.is_set():
                raise ServiceStartError(f"{self.name}: start-up cancelled")
            if self.proc.poll() is not None:
                raise self._exited_error()
            if port_file.exists():
                return int(port_file.read_text())
            time.sleep(0.05)
        raise ServiceStartError(f"{self.name} did not report a port in {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
