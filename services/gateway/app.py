"""The HTTP routes (FastAPI): thin; parsing and framing here, every decision in :mod:`core`.

Errors leave in OpenAI's shape. A client that disconnects cancels its gRPC call: streaming
responses are cancelled by Starlette when the connection drops, and non-streaming ones are raced
against a disconnect watcher here, so an abandoned request never keeps its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.core import Gateway, request_context
from services.gateway.types import (
    APIError,
    CallContext,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from shared.metrics import MODEL_LABEL, PREFIX

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.05


def _version() -> str:
    try:
        return importlib.metadata.version("kvmesh")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs ``work`` until done or until the client goes away (then cancels it: None)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()


class _CountAndTag:
    """Pure ASGI middleware (not ``BaseHTTPMiddleware``, which would buffer streams and hide
    disconnects): counts answers by route and status and echoes ``X-Request-Id``."""

    def __init__(self, app: ASGIApp, counter: Counter, model: str) -> None:
        self.app = app
        self.counter = counter
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = dict(scope.get("headers", [])).get(b"x-request-id")
        status = 500

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if rid and not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            path = getattr(scope.get("route"), "path", "other")
            self.counter.labels(self.model, path, str(status)).inc()


def create_app(gateway: Gateway, registry: CollectorRegistry, model_name: str,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The FastAPI application serving ``gateway``; ``registry`` is what ``/metrics`` shows, with
    ``model_name`` as its label (the deployment's one value, as on every other service)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with contextlib.suppress(APIError):  # warm the model info; a request retries if this failed
            await gateway.info()
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="kvmesh", version=_version(), lifespan=lifespan)
    http_requests = Counter(f"{PREFIX}http_requests_total", "HTTP requests the gateway answered.",
                            [MODEL_LABEL, "route", "status"], registry=registry)

    app.add_middleware(_CountAndTag, counter=http_requests, model=model_name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, request.headers.get("x-request-id"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error_response(APIError(400, message, "invalid_request_error", param, "invalid_value"),
                               request.headers.get("x-request-id"))

    async def generation(request: Request, body: BaseModel, ctx: CallContext,
                         once: Callable[[], Awaitable[BaseModel]],
                         streamed: Callable[[], Awaitable[AsyncIterator[str]]]) -> Response:
        headers = {"X-Request-Id": ctx.request_id}
        if getattr(body, "stream", False):
            events = await _unless_disconnected(request, streamed())
            if events is None:
                return Response(status_code=499)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        result = await _unless_disconnected(request, once())
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result.model_dump(mode="json"), headers=headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = request_context(list(request.headers.items()))
        return await generation(request, body, ctx, lambda: gateway.complete(body, ctx),
                                lambda: gateway.stream_completion(body, ctx))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = request_context(list(request.headers.items()))
        return await generation(request, body, ctx, lambda: gateway.chat(body, ctx),
                                lambda: gateway.stream_chat(body, ctx))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return await gateway.models(request_context(list(request.headers.items())))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        return await gateway.tokenize(body, request_context(list(request.headers.items())))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        return await gateway.detokenize(body, request_context(list(request.headers.items())))

    @app.get("/health")
    async def health() -> Response:
        if await gateway.healthy():
            return Response(status_code=200)
        err = APIError(503, f"the scheduler at {gateway.config.scheduler_address} is not serving",
                       "service_unavailable", None, "unavailable")
        return _error_response(err)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
