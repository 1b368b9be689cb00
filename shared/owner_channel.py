"""A client channel that sends an owner id (``kvmesh-owner`` metadata) on every call.

For tools and tests that drive an owned service directly (benchmarks, integration tests); the
scheduler's adapters pass the metadata per call instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from shared.ownership import OWNER_METADATA


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _AddOwner(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, owner_id: str) -> None:
        self._pair = (OWNER_METADATA, owner_id)

    def _details(self, d: Any) -> _Details:
        metadata = [*(d.metadata or ()), self._pair]
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def with_owner(channel: grpc.Channel, owner_id: str) -> grpc.Channel:
    """``channel`` with ``owner_id`` attached to every call."""
    return grpc.intercept_channel(channel, _AddOwner(owner_id))
