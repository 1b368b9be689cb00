"""The public API's one authentication point: a server interceptor that turns
``authorization: Bearer <key>`` metadata into a :class:`~shared.auth.Tenant` for the servicer.

The HTTP gateway forwards its ``Authorization`` header as this same metadata, so gRPC and HTTP
callers are checked by the same code. Health and reflection stay open (probes carry no key).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

import grpc

from shared.auth import DEFAULT_TENANT, AuthConfig, KeyStore, Tenant
from shared.interceptors import HEALTH_PREFIX, wrap_handler

log = logging.getLogger(__name__)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_OPEN_PREFIXES = (HEALTH_PREFIX, "/grpc.reflection.")
_current: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("kvmesh_tenant", default=None)


def key_store_for(auth: AuthConfig, host: str) -> KeyStore | None:
    """The keys to check, or None when auth is off: only on a loopback bind (or ``mode=off``), logged.

    Raises SystemExit (one line) for a scheduler that would serve a network without keys.
    """
    if auth.mode == "on" or (auth.mode == "auto" and auth.keys_file):
        if not auth.keys_file:
            raise SystemExit("scheduler: KVMESH_AUTH_MODE=on needs KVMESH_AUTH_KEYS_FILE")
        return KeyStore(auth.keys_file, auth.reload_seconds)
    if auth.mode == "auto" and host not in _LOOPBACK:
        raise SystemExit(f"scheduler: binding {host} needs API keys: set KVMESH_AUTH_KEYS_FILE "
                         "(or KVMESH_AUTH_MODE=off to serve without authentication)")
    log.warning("scheduler: authentication is OFF (host %s): every caller is tenant 'default'", host)
    return None


def current_tenant() -> Tenant:
    """The calling tenant, set by :class:`AuthInterceptor` for this RPC (``default`` without one)."""
    return _current.get() or Tenant(DEFAULT_TENANT)


def bearer_key(metadata: Any) -> str | None:
    """The key of an ``authorization: Bearer <key>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _deny(message: str) -> Callable[[Any, grpc.ServicerContext], None]:
    def check(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return check


def _with_tenant(handler: Any, tenant: Tenant) -> Any:
    # NOTE: the tenant is set inside the behaviour, which runs on the RPC's worker thread (for a
    # stream: where gRPC iterates the generator), not in intercept_service's thread.
    def check(_request: Any, _context: grpc.ServicerContext) -> None:
        _current.set(tenant)

    return wrap_handler(handler, check)


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without a valid key (``UNAUTHENTICATED``); with ``keys=None`` everyone is ``default``."""

    def __init__(self, keys: KeyStore | None) -> None:
        self.keys = keys

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        if self.keys is None:
            return _with_tenant(handler, Tenant(DEFAULT_TENANT))
        key = bearer_key(details.invocation_metadata)
        if key is None:
            return wrap_handler(handler, _deny("missing API key: send 'authorization: Bearer <key>' metadata"))
        tenant = self.keys.authenticate(key)
        if tenant is None:
            return wrap_handler(handler, _deny("invalid API key"))
        return _with_tenant(handler, tenant)
