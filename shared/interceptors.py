"""Server interceptors' one way to wrap a method handler, and the error mapping every server runs.

gRPC's ``ServerInterceptor`` hands over a method handler whose behaviour must be rebuilt for its
kind (unary or streaming request and response) with the same (de)serializers; each interceptor
used to write that four ways. :func:`wrap_handler` does it once: a check that runs first, on the
RPC's own thread (for a stream: where gRPC iterates the generator, so context variables set there
reach the servicer), and an optional error hook around the behaviour.

:class:`ErrorMappingInterceptor` is the innermost interceptor of every kvmesh server
(``shared.grpc_server.start_server``): exceptions become the status they name instead of an opaque
``UNKNOWN``, malformed request bytes become ``INVALID_ARGUMENT`` with one log line, and a draining
server refuses new calls.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from shared.errors import KVMeshError

log = logging.getLogger(__name__)
HEALTH_PREFIX = "/grpc.health.v1."

# (request, context) -> None; aborts the call (``context.abort``) to refuse it.
Check = Callable[[Any, grpc.ServicerContext], None]
# (exception, context) -> None; aborts with the status it chooses, or returns to let it propagate.
ErrorHook = Callable[[Exception, grpc.ServicerContext], None]
Deserializer = Callable[[bytes], Any] | None

ALL_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
_BUILDERS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def wrap_handler(handler: Any, check: Check, *, on_error: ErrorHook | None = None,
                 kinds: Sequence[str] = ALL_KINDS,
                 deserializer: Callable[[Deserializer], Deserializer] | None = None) -> Any:
    """``handler`` with ``check`` run before its behaviour and ``on_error`` around it.

    Args:
        handler: what ``continuation(details)`` returned (None passes through).
        check: runs first on every call; refuses it by aborting.
        on_error: sees every exception of the behaviour; when it returns, the exception propagates.
        kinds: the handler kinds to wrap; a handler of another kind is returned unchanged.
        deserializer: replaces the request deserializer (given the original one).
    """
    if handler is None:
        return None
    for kind in kinds:
        inner = getattr(handler, kind)
        if inner is None:
            continue
        streams = kind.endswith("_stream")
        behaviour = _streaming(inner, check, on_error) if streams else _unary(inner, check, on_error)
        request_deserializer = handler.request_deserializer
        return _BUILDERS[kind](
            behaviour, response_serializer=handler.response_serializer,
            request_deserializer=deserializer(request_deserializer) if deserializer else request_deserializer)
    return handler


def _unary(inner: Callable[..., Any], check: Check, on_error: ErrorHook | None) -> Callable[..., Any]:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        check(request, context)
        try:
            return inner(request, context)
        except Exception as exc:
            if on_error is not None:
                on_error(exc, context)
            raise

    return behaviour


def _streaming(inner: Callable[..., Iterator[Any]], check: Check,
               on_error: ErrorHook | None) -> Callable[..., Iterator[Any]]:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        check(request, context)
        try:
            yield from inner(request, context)
        except Exception as exc:
            if on_error is not None:
                on_error(exc, context)
            raise

    return behaviour


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KVMeshError):
        return getattr(grpc.StatusCode, exc.status), str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"


def _internal(method: str, context: grpc.ServicerContext, exc: BaseException) -> None:
    """Logs an unexpected exception under a fresh error id and aborts with a clean message.

    NOTE: exception text can name internal addresses, paths and peers; clients get the id only,
    operators find the details in the log by it.
    """
    error_id = uuid.uuid4().hex[:12]
    log.error("unhandled error in %s (error id %s)", method, error_id, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (error id {error_id})")


class _Malformed:
    """What a request deserializer returns for bytes that are not a valid message."""

    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int) -> None:
        self.error = error
        self.size = size


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Wraps a request deserializer so a parse failure reaches the handler as a value.

    grpc itself answers a raising deserializer with ``INTERNAL`` and a traceback per call.
    """
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, and whatever a custom deserializer raises
            return _Malformed(exc, len(data))

    return deserialize


def _refuse_malformed(method: str, request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        log.warning("%s: malformed request message (%d bytes): %s", method, request.size, request.error)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid protobuf message for this method")


class Gate:
    """Whether the server still takes new calls (health checks are always answered)."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    def refuse(self, method: str, context: grpc.ServicerContext) -> None:
        if self._closed.is_set() and not method.startswith(HEALTH_PREFIX):
            context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another instance")


def _already_aborted(context: grpc.ServicerContext) -> bool:
    # context.abort() raises an Exception subclass; do not re-abort such a call.
    code = getattr(context, "code", None)
    return callable(code) and code() is not None


class ErrorMappingInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Aborts the call with the status an exception names, instead of an opaque UNKNOWN.

    Also refuses new calls once the server drains, and malformed request bytes, before the
    handler runs.
    """

    def __init__(self, gate: Gate | None = None) -> None:
        self._gate = gate or Gate()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method: str = details.method
        gate = self._gate

        def check(request: Any, context: grpc.ServicerContext) -> None:
            gate.refuse(method, context)
            _refuse_malformed(method, request, context)

        def on_error(exc: Exception, context: grpc.ServicerContext) -> None:
            if isinstance(exc, KVMeshError):
                context.abort(*_status_of(exc))
            if not _already_aborted(context):
                _internal(method, context, exc)  # a downstream RpcError too: it names the peer

        return wrap_handler(continuation(details), check, on_error=on_error,
                            kinds=("unary_unary", "unary_stream"), deserializer=_tolerant)
