"""The gRPC server every kvmesh service runs: health, reflection, error mapping, graceful stop.

A service supplies its servicer registrations; this module adds the standard
``grpc.health.v1`` service (so Kubernetes ``grpc:`` probes and grpcurl work), server reflection,
an interceptor that turns :mod:`shared.errors` exceptions into status codes, and a SIGTERM /
SIGINT handler that marks the server NOT_SERVING and drains in-flight calls before exiting.

Servers bind without ``SO_REUSEPORT`` (a port in use is an error at start, never a silently shared
port), accept messages up to a configured size, and answer malformed request bytes with
``INVALID_ARGUMENT`` and one log line. See docs/lifecycle.md.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.config import MAX_MESSAGE_BYTES, ServerConfig
from shared.errors import PortInUseError
from shared.gc_heap import freeze_startup_heap
from shared.interceptors import ErrorMappingInterceptor, Gate
from shared.peer_auth import PeerIdentityInterceptor
from shared.tls import TLSFiles, server_credentials

log = logging.getLogger(__name__)

# A health name that stays SERVING while the process runs (readiness may not): the liveness
# probe's target, so a dependency outage makes a pod unready without getting it restarted.
LIVENESS_SERVICE = "kvmesh.liveness"
# Keepalive: pings find dead peers (a killed pod, a dropped NAT entry) in bounded time; the
# server tolerates client pings this frequent, and no more (too-chatty clients get GOAWAY).
KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)



@dataclass(frozen=True)
class ServiceName:
    """A service's one name, in its two spellings; each service defines it once, in its servicer.

    Attributes:
        label: ``"kv-cache-manager"``: what ``kvmesh serve`` calls it, its log lines, tracing's
            ``service.name``.
        grpc: the proto service's full name (``"kvmesh.v1.KVCacheManager"``): health and
            reflection, taken from the generated descriptor so it cannot drift from the proto.
    """

    label: str
    grpc: str

    @classmethod
    def of(cls, label: str, pb_module: Any, service: str) -> ServiceName:
        """``label`` and the full name of ``service`` in the generated ``*_pb2`` module."""
        return cls(label, pb_module.DESCRIPTOR.services_by_name[service].full_name)


@dataclass(frozen=True)
class ServiceRegistration:
    """One servicer to mount: its full proto service name and the generated ``add_*`` function."""

    service_name: str
    servicer: Any
    add_to_server: Callable[[Any, grpc.Server], None]


class RunningServer:
    """A started server: its bound port, health state and a blocking wait for shutdown."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 names: Sequence[str], grace: float, gate: Gate | None = None) -> None:
        self.server = server
        self.port = port
        self._health = health_servicer
        self._names = list(names)
        self._grace = grace
        self._gate = gate or Gate()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def set_serving(self, serving: bool) -> None:
        """Readiness: SERVING or NOT_SERVING for the server and every service on it.

        The liveness name (:data:`LIVENESS_SERVICE`) keeps SERVING; once the server stops
        nothing turns it back to SERVING.
        """
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._lock:
            if self._stopping.is_set():
                return
            for name in ["", *self._names]:
                self._health.set(name, status)

    def set_status(self, name: str, serving: bool) -> None:
        """Health of an extra name (e.g. one dependency's state); ignored once stopping."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._lock:
            if not self._stopping.is_set():
                self._health.set(name, status)

    def stop(self, grace: float | None = None, drain: Callable[[float], object] | None = None) -> None:
        """Stops in order: health NOT_SERVING, new calls refused (``UNAVAILABLE``), in-flight calls
        drained for ``grace`` seconds, then the server closed.

        Args:
            drain: ends in-flight work itself within the grace it is given (e.g. the scheduler
                finishes its streams with a final chunk); the server then closes, cancelling
                whatever is left after one more second.
        """
        with self._lock:
            if self._stopping.is_set():
                self._stopped.wait()
                return
            self._stopping.set()
            for name in ["", *self._names, LIVENESS_SERVICE]:
                self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._gate.close()
        grace = self._grace if grace is None else grace
        try:
            if drain is not None:
                drain(grace)
                grace = 1.0
        except Exception:
            log.exception("drain failed; closing the server")
        finally:
            self.server.stop(grace).wait()
            self._stopped.set()

    def wait(self) -> None:
        """Blocks until the server has stopped."""
        self.server.wait_for_termination()


def check_port_free(host: str, port: int) -> None:
    """Fails in one line when ``host:port`` is taken, before grpc logs its own bind error.

    A plain bind with ``SO_REUSEADDR`` (as grpc binds) and without ``SO_REUSEPORT`` fails exactly
    when a listener holds the port. Racy by nature; the server's own bind is the guarantee.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::", "[::]") else host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(f"port {port} on {host} is already in use") from None
            raise


def server_options(config: ServerConfig, extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """The options every server gets, then ``extra`` (which wins for the same key)."""
    options: dict[str, Any] = {
        # NOTE: grpc's default lets a second server bind a port in use and split the traffic.
        "grpc.so_reuseport": 0,
        "grpc.max_receive_message_length": config.max_receive_message_bytes,
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        **dict(KEEPALIVE_OPTIONS),
    }
    options.update(dict(extra))
    return list(options.items())


def start_server(
    config: ServerConfig,
    registrations: Sequence[ServiceRegistration],
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> RunningServer:
    """Creates, binds and starts a server with health, reflection and error mapping.

    Raises:
        PortInUseError: the configured port is taken.
    """
    tls = TLSFiles(config.tls_cert, config.tls_key, config.tls_ca)
    if tls.enabled:  # every RPC but health must come over TLS (the health-only port is plaintext)
        # Names are checked only where client certificates are required (not on the public port).
        names = config.tls_allowed_peers.split(",") if config.tls_client_auth and config.tls_ca else []
        allowed = frozenset(n.strip() for n in names if n.strip())
        interceptors = [PeerIdentityInterceptor(allowed), *interceptors]
    gate = Gate()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers),
        # NOTE: error mapping innermost, so outer interceptors (tracing) see the mapped status.
        interceptors=[*interceptors, ErrorMappingInterceptor(gate)],
        options=server_options(config, options),
    )
    for reg in registrations:
        reg.add_to_server(reg.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [reg.service_name for reg in registrations]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if config.port:
        check_port_free(config.host, config.port)
    if config.health_port > 0:
        check_port_free(config.host, config.health_port)
    address = f"{config.host}:{config.port}"
    try:
        if tls.enabled:
            port = server.add_secure_port(address, server_credentials(tls, config.tls_client_auth))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc >= 1.50 raises instead of returning 0
        raise PortInUseError(f"could not bind {address}: {exc}") from None
    if port == 0:
        raise PortInUseError(f"could not bind {address}")
    if config.health_port >= 0:
        try:
            health_bound = server.add_insecure_port(f"{config.host}:{config.health_port}")
        except RuntimeError as exc:
            raise PortInUseError(f"could not bind the health port {config.host}:{config.health_port}: {exc}") from None
        if health_bound == 0:
            raise PortInUseError(f"could not bind the health port {config.host}:{config.health_port}")
    server.start()
    for name in ["", *names, LIVENESS_SERVICE]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        tmp = Path(config.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(config.port_file)
    return RunningServer(server, port, health_servicer, names, config.grace_seconds, gate)


def serve_forever(running: RunningServer, label: str, on_stop: Callable[[], None] | None = None,
                  drain: Callable[[float], object] | None = None) -> None:
    """Logs where the server listens and blocks until SIGTERM/SIGINT, then stops gracefully.

    Args:
        on_stop: runs before the drain, e.g. to end streams that never finish on their own
            (they would otherwise hold the drain for the whole grace period).
        drain: passed to :meth:`RunningServer.stop`: ends in-flight work within the grace.
    """
    done = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("%s: signal %d, draining", label, signum)
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    frozen = freeze_startup_heap()  # start-up is over: full collections skip its heap from here on
    log.info("%s: %d start-up objects frozen out of the garbage collector's full passes", label, frozen)
    print(f"kvmesh {label} listening on port {running.port}", flush=True)
    done.wait()
    if on_stop is not None:
        on_stop()
    running.stop(drain=drain)
    log.info("%s: stopped", label)
