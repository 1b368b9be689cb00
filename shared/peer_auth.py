"""Who may call a TLS-enabled server: every RPC except health checks must arrive over TLS (the
plaintext health-only port answers probes, nothing else), and, when a list of allowed peers is
configured, the client certificate's common name or a DNS SAN must be on it.

The handshake itself already refuses a client without a certificate signed by the service CA
(``require_client_auth``); this interceptor adds what the handshake cannot know: which port a call
came in on, and which service a valid certificate belongs to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from shared.interceptors import HEALTH_PREFIX, wrap_handler


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
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        allowed = self.allowed
        return wrap_handler(handler, lambda _request, context: _check(context, allowed))
