"""The gRPC server every kvmesh service runs: health, reflection, error mapping, graceful stop.

A service supplies its servicer registrations; this module adds the standard
``grpc.health.v1`` service (so Kubernetes ``grpc:`` probes and grpcurl work), server reflection,
an interceptor that turns :mod:`shared.errors` exceptions into status codes, and a SIGTERM /
SIGINT handler that marks the server NOT_SERVING and drains in-flight calls before exiting.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.channels import MAX_MESSAGE_BYTES
from shared.config import ServerConfig
from shared.errors import KVMeshError
from shared.peer_auth import PeerIdentityInterceptor
from shared.tls import TLSFiles, server_credentials

log = logging.getLogger(__name__)

# NOTE: set on purpose (docs/security.md): 64 MiB messages like every channel (shared/channels.py);
# clients' keepalive pings (30 s, only while calls are open) accepted instead of answered with
# GOAWAY "too_many_pings"; the server pings idle connections every 60 s so a client that vanished
# without a FIN ends its streams (and frees its blocks) instead of holding them forever.
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KVMeshError):
        return getattr(grpc.StatusCode, exc.status), str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _already_aborted(context: grpc.ServicerContext) -> bool:
    # context.abort() raises an Exception subclass; do not re-abort such a call.
    code = getattr(context, "code", None)
    return callable(code) and code() is not None


class ErrorMappingInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Aborts the call with the status an exception names, instead of an opaque UNKNOWN."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return inner_uu(request, context)
                except KVMeshError as exc:
                    code, msg = _status_of(exc)
                    context.abort(code, msg)
                except Exception as exc:
                    if isinstance(exc, grpc.RpcError) or _already_aborted(context):
                        raise
                    log.exception("unhandled error in %s", details.method)
                    code, msg = _status_of(exc)
                    context.abort(code, msg)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_us(request, context)
                except KVMeshError as exc:
                    code, msg = _status_of(exc)
                    context.abort(code, msg)
                except Exception as exc:
                    if isinstance(exc, grpc.RpcError) or _already_aborted(context):
                        raise
                    log.exception("unhandled error in %s", details.method)
                    code, msg = _status_of(exc)
                    context.abort(code, msg)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


@dataclass(frozen=True)
class ServiceRegistration:
    """One servicer to mount: its full proto service name and the generated ``add_*`` function."""

    service_name: str
    servicer: Any
    add_to_server: Callable[[Any, grpc.Server], None]


class RunningServer:
    """A started server: its bound port, health state and a blocking wait for shutdown."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 names: Sequence[str], grace: float) -> None:
        self.server = server
        self.port = port
        self._health = health_servicer
        self._names = list(names)
        self._grace = grace
        self._stopped = threading.Event()

    def stop(self, grace: float | None = None) -> None:
        """Marks every service NOT_SERVING, then stops accepting calls and drains in-flight ones."""
        if self._stopped.is_set():
            return
        for name in ["", *self._names]:
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(self._grace if grace is None else grace).wait()
        self._stopped.set()

    def wait(self) -> None:
        """Blocks until the server has stopped."""
        self.server.wait_for_termination()


def start_server(
    config: ServerConfig,
    registrations: Sequence[ServiceRegistration],
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> RunningServer:
    """Creates, binds and starts a server with health, reflection and error mapping."""
    tls = TLSFiles(config.tls_cert, config.tls_key, config.tls_ca)
    if tls.enabled:  # every RPC but health must come over TLS (the health-only port is plaintext)
        # Names are checked only where client certificates are required (not on the public port).
        names = config.tls_allowed_peers.split(",") if config.tls_client_auth and config.tls_ca else []
        allowed = frozenset(n.strip() for n in names if n.strip())
        interceptors = [PeerIdentityInterceptor(allowed), *interceptors]
    given = {key for key, _ in options}
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers),
        # NOTE: error mapping innermost, so outer interceptors (tracing) see the mapped status.
        interceptors=[*interceptors, ErrorMappingInterceptor()],
        options=[*(o for o in SERVER_OPTIONS if o[0] not in given), *options],
    )
    for reg in registrations:
        reg.add_to_server(reg.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [reg.service_name for reg in registrations]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if tls.enabled:
        port = server.add_secure_port(f"{config.host}:{config.port}",
                                      server_credentials(tls, config.tls_client_auth))
    else:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    if config.health_port >= 0 and server.add_insecure_port(f"{config.host}:{config.health_port}") == 0:
        raise OSError(f"could not bind the health port {config.host}:{config.health_port}")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        tmp = Path(config.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(config.port_file)
    return RunningServer(server, port, health_servicer, names, config.grace_seconds)


def serve_forever(running: RunningServer, label: str, on_stop: Callable[[], None] | None = None) -> None:
    """Logs where the server listens and blocks until SIGTERM/SIGINT, then stops gracefully.

    Args:
        on_stop: runs before the drain, e.g. to end streams that never finish on their own
            (they would otherwise hold the drain for the whole grace period).
    """
    done = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("%s: signal %d, draining", label, signum)
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"kvmesh {label} listening on port {running.port}", flush=True)
    done.wait()
    if on_stop is not None:
        on_stop()
    running.stop()
    log.info("%s: stopped", label)
