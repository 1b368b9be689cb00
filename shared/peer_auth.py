"""Who may call a TLS-enabled server: every RPC except health checks must arrive over TLS (the
plaintext health-only port answers probes, nothing else), and, when a list of allowed peers is
configured, the client certificate's common name or a DNS SAN must be on it.

The handshake itself already refuses a client without a certificate signed by the service CA
(``require_client_auth``); this interceptor adds what the handshake cannot know: which port a call
came in on, and which service a valid certificate belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

_HEALTH_PREFIX = "/grpc.health.v1."


def peer_names(context: grpc.ServicerContext) -> set[str]:
    """The client certificate's CN and SAN names (empty without a verified certificate)."""
    auth = context.auth_context()
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(bytes(v).decode(errors="replace") for v in auth.get(key, ()))
    return names


def _check(context: grpc.ServicerContext, allowed: frozenset[str]) -> None:
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "this port serves health checks only; use TLS")
    if allowed and not peer_names(context) & allowed:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "this client certificate may not call this service")


class PeerIdentityInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Requires TLS (and an allowed certificate name) for every RPC but health checks."""

    def __init__(self, allowed_peers: frozenset[str] = frozenset()) -> None:
        self.allowed = allowed_peers

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        allowed = self.allowed
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                _check(context, allowed)
                return inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                _check(context, allowed)
                yield from inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:  # reflection
            inner_ss = handler.stream_stream

            def stream_stream(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                _check(context, allowed)
                yield from inner_ss(requests, context)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler
