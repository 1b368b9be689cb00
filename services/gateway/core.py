"""The gateway's logic: OpenAI requests in, scheduler calls out, OpenAI responses back.

Holds no engine state: the only things kept are the scheduler's model info (fetched once) and
token-id -> text strings for logprobs (a function of the tokenizer, bounded by the vocabulary).
Free of grpc and of HTTP framework types, so it is tested through the app, and reusable.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel

from services.gateway import convert
from services.gateway.config import GatewayConfig
from services.gateway.types import (
    APIError,
    CallContext,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelInfo,
    SchedulerAPI,
    TokenizeRequest,
    UpstreamError,
)
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def new_request_id() -> str:
    """A fresh id when the client sent no ``X-Request-Id``."""
    return uuid.uuid4().hex


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=True)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


class Gateway:
    """OpenAI's endpoints over one scheduler."""

    def __init__(self, config: GatewayConfig, scheduler: SchedulerAPI) -> None:
        self.config = config
        self.scheduler = scheduler
        self.cached_info: ModelInfo | None = None
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------------------------ model

    async def info(self, ctx: CallContext | None = None) -> ModelInfo:
        """The scheduler's model info, fetched on first use (503 while it cannot be reached)."""
        if self.cached_info is None:
            try:
                self.cached_info = await self.scheduler.model_info(ctx)
            except UpstreamError as exc:
                raise self._error(exc) from None
        return self.cached_info

    async def served_name(self, ctx: CallContext | None = None) -> str:
        """The one model name this gateway answers to."""
        return self.config.served_model_name or (await self.info(ctx)).model_id

    async def models(self, ctx: CallContext) -> dict[str, Any]:
        """``GET /v1/models``: asks the scheduler each time with the caller's credentials, so an
        unauthenticated caller learns nothing the scheduler would not tell it."""
        try:
            info = self.cached_info = await self.scheduler.model_info(ctx)
        except UpstreamError as exc:
            raise self._error(exc) from None
        name = await self.served_name(ctx)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": info.model_id,
            "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
        }]}

    async def _check_model(self, model: str | None, ctx: CallContext) -> str:
        name = await self.served_name(ctx)
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`.",
                           "not_found_error", "model", "model_not_found")
        return name

    async def healthy(self) -> bool:
        """Whether the scheduler answers its health check."""
        return await self.scheduler.healthy(self.config.health_timeout_seconds)

    def _error(self, exc: UpstreamError) -> APIError:
        return convert.error_from_upstream(exc, self.config.retry_after_seconds)

    # ---------------------------------------------------------------------------- tokenization

    async def tokenize(self, req: TokenizeRequest, ctx: CallContext) -> dict[str, Any]:
        """``POST /tokenize``: vLLM's answer shape (tokens, count, max_model_len)."""
        await self._check_model(req.model, ctx)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: send exactly one of prompt or messages", param="prompt")
        msg = scheduler_pb2.TokenizeRequest(add_special_tokens=req.add_special_tokens)
        if req.messages is not None:
            msg.chat.CopyFrom(convert.chat_messages(req.messages))
        else:
            msg.text = req.prompt or ""
        try:
            ids = await self.scheduler.tokenize(msg, ctx)
        except UpstreamError as exc:
            raise self._error(exc) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": (await self.info(ctx)).max_model_len}

    async def detokenize(self, req: DetokenizeRequest, ctx: CallContext) -> dict[str, Any]:
        """``POST /detokenize``."""
        await self._check_model(req.model, ctx)
        try:
            return {"prompt": await self.scheduler.detokenize(req.tokens, ctx)}
        except UpstreamError as exc:
            raise self._error(exc) from None

    async def _token_strings(self, ids: set[int], ctx: CallContext) -> dict[int, str]:
        missing = sorted(ids - self._token_text.keys())
        if missing:
            texts = await asyncio.gather(*(self.scheduler.detokenize([t], ctx) for t in missing))
            self._token_text.update(zip(missing, texts, strict=True))
        return {t: self._token_text[t] for t in ids}

    # ------------------------------------------------------------------------------- requests

    async def completion_request(self, req: CompletionRequest, ctx: CallContext) -> scheduler_pb2.GenerateRequest:
        """Validates a completions body and builds the scheduler's ``GenerateRequest``."""
        await self._check_model(req.model, ctx)
        convert.check_common(req)
        if req.echo:
            raise convert.unsupported("echo", "is not supported")
        if req.suffix:
            raise convert.unsupported("suffix", "is not supported")
        if req.best_of not in (None, 1):
            raise convert.unsupported("best_of", f"only best_of=1 is supported, got {req.best_of}")
        out = self._generate_request(req, req.logprobs, ctx)
        out.max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise convert.unsupported("prompt", "a batch of prompts is not supported; send one per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            out.text = prompt
        else:
            out.token_ids.ids.extend(prompt)
        return out

    async def chat_request(self, req: ChatCompletionRequest, ctx: CallContext) -> scheduler_pb2.GenerateRequest:
        """Validates a chat body and builds the scheduler's ``GenerateRequest``."""
        await self._check_model(req.model, ctx)
        convert.check_common(req)
        if req.tools:
            raise convert.unsupported("tools", "tool calling is not supported")
        if req.tool_choice not in (None, "none"):
            raise convert.unsupported("tool_choice", "tool calling is not supported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise convert.unsupported("response_format", "only type=text is supported")
        out = self._generate_request(req, convert.chat_logprobs_count(req), ctx)
        chat = convert.chat_messages(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            # NOTE: chat's default is "the rest of the context", which needs the prompt's length:
            # tokenize once here and send the ids, so the scheduler does not tokenize it again.
            try:
                ids = await self.scheduler.tokenize(scheduler_pb2.TokenizeRequest(chat=chat), ctx)
            except UpstreamError as exc:
                raise self._error(exc) from None
            out.token_ids.ids.extend(ids)
            out.max_tokens = convert.default_max_tokens(await self.info(ctx), len(ids))
        else:
            out.chat.CopyFrom(chat)
            out.max_tokens = max_tokens
        return out

    def _generate_request(self, req: Any, logprobs: int | None, ctx: CallContext) -> scheduler_pb2.GenerateRequest:
        return scheduler_pb2.GenerateRequest(
            sampling=convert.sampling_to_proto(req, logprobs), stop=convert.stops(req),
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, request_id=ctx.request_id,
            priority=req.priority, cache_salt=req.cache_salt or "", include_special_tokens=not req.skip_special_tokens,
        )

    def _timeout(self) -> float | None:
        return self.config.request_timeout_seconds or None

    async def _open(self, request: scheduler_pb2.GenerateRequest, ctx: CallContext
                    ) -> tuple[scheduler_pb2.GenerateResponse | None, AsyncIterator[scheduler_pb2.GenerateResponse]]:
        """Starts the call and waits for its first chunk, so validation and admission errors get
        their own HTTP status instead of arriving inside a 200 stream."""
        stream = self.scheduler.generate(request, ctx, self._timeout())
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return None, stream
        except UpstreamError as exc:
            raise self._error(exc) from None
        except BaseException:
            await stream.aclose()  # type: ignore[attr-defined]
            raise
        return first, stream

    async def _collect(self, request: scheduler_pb2.GenerateRequest, ctx: CallContext
                       ) -> tuple[str, list[int], list[common_pb2.SampledLogprobs], scheduler_pb2.GenerateFinal]:
        pieces: list[str] = []
        ids: list[int] = []
        logprobs: list[common_pb2.SampledLogprobs] = []
        final: scheduler_pb2.GenerateFinal | None = None
        try:
            async with aclosing(self.scheduler.generate(request, ctx, self._timeout())) as stream:  # type: ignore[type-var]
                async for chunk in stream:
                    pieces.append(chunk.text)
                    ids.extend(chunk.token_ids)
                    logprobs.extend(chunk.logprobs)
                    if chunk.HasField("final"):
                        final = chunk.final
        except UpstreamError as exc:
            raise self._error(exc) from None
        if final is None:
            raise APIError(502, "the scheduler ended the stream without a final chunk", "internal_error")
        return "".join(pieces), ids, logprobs, final

    # ---------------------------------------------------------------------------- completions

    async def complete(self, req: CompletionRequest, ctx: CallContext) -> CompletionResponse:
        """A non-streaming completion."""
        request = await self.completion_request(req, ctx)
        text, ids, entries, final = await self._collect(request, ctx)
        lp = None
        if req.logprobs is not None:
            lp = convert.completion_logprobs(
                entries, await self._token_strings(convert.logprob_token_ids(entries), ctx), 0)
        return CompletionResponse(
            id=f"cmpl-{ctx.request_id}", created=int(time.time()), model=await self.served_name(ctx),
            choices=[CompletionChoice(text=text, logprobs=lp, finish_reason=convert.finish_reason(final),
                                      stop_reason=convert.stop_reason(final),
                                      token_ids=ids if req.return_token_ids else None)],
            usage=convert.usage(final))

    async def stream_completion(self, req: CompletionRequest, ctx: CallContext) -> AsyncIterator[str]:
        """A streaming completion: validated and started before the first event is returned."""
        request = await self.completion_request(req, ctx)
        first, stream = await self._open(request, ctx)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        name = await self.served_name(ctx)
        created = int(time.time())
        rid = f"cmpl-{ctx.request_id}"

        async def events() -> AsyncIterator[str]:
            offset = 0
            async with aclosing(self._chunks(first, stream)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    final = chunk.final if chunk.HasField("final") else None
                    lp = None
                    if req.logprobs is not None and chunk.logprobs:
                        strings = await self._token_strings(convert.logprob_token_ids(chunk.logprobs), ctx)
                        lp = convert.completion_logprobs(chunk.logprobs, strings, offset)
                    offset += len(chunk.text)
                    if chunk.text or chunk.token_ids or lp is not None or final is not None:
                        choice = CompletionChoice(text=chunk.text, logprobs=lp,
                                                  token_ids=list(chunk.token_ids) if req.return_token_ids else None)
                        if final is not None:
                            choice.finish_reason = convert.finish_reason(final)
                            choice.stop_reason = convert.stop_reason(final)
                        yield sse(CompletionResponse(id=rid, created=created, model=name, choices=[choice]))
                    if final is not None and include_usage:
                        yield sse(CompletionResponse(id=rid, created=created, model=name, choices=[],
                                                     usage=convert.usage(final)))

        return self._framed(events())

    # ----------------------------------------------------------------------------------- chat

    async def chat(self, req: ChatCompletionRequest, ctx: CallContext) -> ChatCompletionResponse:
        """A non-streaming chat completion."""
        request = await self.chat_request(req, ctx)
        text, ids, entries, final = await self._collect(request, ctx)
        lp = None
        if req.logprobs:
            lp = convert.chat_logprobs(entries, await self._token_strings(convert.logprob_token_ids(entries), ctx))
        return ChatCompletionResponse(
            id=f"chatcmpl-{ctx.request_id}", created=int(time.time()), model=await self.served_name(ctx),
            choices=[ChatChoice(message=ChatMessage(role="assistant", content=text), logprobs=lp,
                                finish_reason=convert.finish_reason(final), stop_reason=convert.stop_reason(final),
                                token_ids=ids if req.return_token_ids else None)],
            usage=convert.usage(final))

    async def stream_chat(self, req: ChatCompletionRequest, ctx: CallContext) -> AsyncIterator[str]:
        """A streaming chat completion: a role chunk, content deltas, the finish, then usage."""
        request = await self.chat_request(req, ctx)
        first, stream = await self._open(request, ctx)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        name = await self.served_name(ctx)
        created = int(time.time())
        rid = f"chatcmpl-{ctx.request_id}"

        def chunk_of(choices: list[ChatChunkChoice], usage: Any = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=choices, usage=usage))

        async def events() -> AsyncIterator[str]:
            yield chunk_of([ChatChunkChoice(delta=ChatMessage(role="assistant", content=""))])
            async with aclosing(self._chunks(first, stream)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    final = chunk.final if chunk.HasField("final") else None
                    lp = None
                    if req.logprobs and chunk.logprobs:
                        strings = await self._token_strings(convert.logprob_token_ids(chunk.logprobs), ctx)
                        lp = convert.chat_logprobs(chunk.logprobs, strings)
                    if chunk.text or chunk.token_ids or lp is not None:
                        yield chunk_of([ChatChunkChoice(
                            delta=ChatMessage(content=chunk.text), logprobs=lp,
                            token_ids=list(chunk.token_ids) if req.return_token_ids else None)])
                    if final is not None:
                        yield chunk_of([ChatChunkChoice(delta=ChatMessage(), finish_reason=convert.finish_reason(final),
                                                        stop_reason=convert.stop_reason(final))])
                        if include_usage:
                            yield chunk_of([], convert.usage(final))

        return self._framed(events())

    # ------------------------------------------------------------------------------- framing

    @staticmethod
    async def _chunks(first: scheduler_pb2.GenerateResponse | None,
                      stream: AsyncIterator[scheduler_pb2.GenerateResponse]
                      ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        async with aclosing(stream):  # type: ignore[type-var]
            if first is not None:
                yield first
            async for chunk in stream:
                yield chunk

    async def _framed(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Events, then ``[DONE]``; a failure after the first byte becomes an error event (the
        status line is already sent). Closing this generator (client gone) closes the gRPC call."""
        async with aclosing(events):  # type: ignore[type-var]
            try:
                async for event in events:
                    yield event
            except UpstreamError as exc:
                yield sse(self._error(exc).body())
        yield "data: [DONE]\n\n"


def request_context(headers: Sequence[tuple[str, str]]) -> CallContext:
    """The ids and credentials of one HTTP request (header names lower-case)."""
    found = dict(headers)
    auth = found.get("authorization")
    return CallContext(request_id=found.get("x-request-id") or new_request_id(), authorization=auth)
