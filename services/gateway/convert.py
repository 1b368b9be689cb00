"""OpenAI bodies <-> the scheduler's protobuf messages, both directions, and scheduler status
codes -> OpenAI errors. Pure functions: no I/O, no grpc imports."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from services.gateway.types import (
    APIError,
    ChatCompletionRequest,
    ChatLogprob,
    ChatLogprobs,
    ChatMessageParam,
    CompletionLogprobs,
    ModelInfo,
    PromptTokensDetails,
    SamplingRequest,
    TopLogprob,
    UpstreamError,
    Usage,
)
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2

FINISH_REASONS = {
    scheduler_pb2.FINISH_REASON_STOP: "stop",
    scheduler_pb2.FINISH_REASON_LENGTH: "length",
    scheduler_pb2.FINISH_REASON_ABORT: "abort",
}

# gRPC status name -> (HTTP status, OpenAI error type). RESOURCE_EXHAUSTED is the scheduler's
# admission control (queue full), which OpenAI clients retry on 429 with backoff.
STATUS_MAP: Mapping[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
# The scheduler's messages start with the field they blame ("max_tokens: ...", "sampling.top_p must").
_FIELD = re.compile(r"^([a-z_][a-z_.]*)(?::| must| is)")
# Scheduler field names -> the OpenAI parameter a client sent.
_PARAMS = {"prompt": "prompt", "chat": "messages", "chat.messages.role": "messages"}


def error_from_upstream(exc: UpstreamError, retry_after_seconds: int) -> APIError:
    """A scheduler failure as the OpenAI error a client expects (status, type, param)."""
    status, kind = STATUS_MAP.get(exc.code, (500, "internal_error"))
    param = None
    if status == 400:
        m = _FIELD.match(exc.message)
        if m:
            name = m.group(1)
            param = _PARAMS.get(name, name.removeprefix("sampling."))
    headers = {"Retry-After": str(retry_after_seconds)} if status == 429 else {}
    return APIError(status, exc.message, kind, param, exc.code.lower(), headers)


def unsupported(param: str, why: str) -> APIError:
    """A 400 for a parameter the engine does not implement (never silently ignored)."""
    return APIError(400, f"{param}: {why}", "invalid_request_error", param, "unsupported_parameter")


def check_common(req: SamplingRequest) -> None:
    """Refuses the OpenAI parameters that would change the answer but that the engine lacks."""
    if req.n != 1:
        raise unsupported("n", f"only n=1 is supported, got {req.n}")
    if req.logit_bias:
        raise unsupported("logit_bias", "is not supported by the engine")
    if req.min_tokens:
        raise unsupported("min_tokens", "is not supported by the engine")


def sampling_to_proto(req: SamplingRequest, logprobs: int | None) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields as the scheduler's ``SamplingParams`` (unset stays unset)."""
    sp = common_pb2.SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default is 1
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
    )
    if req.top_p is not None:
        sp.top_p = req.top_p
    if req.repetition_penalty is not None:
        sp.repetition_penalty = req.repetition_penalty
    if req.seed is not None:
        if req.seed < 0:
            raise APIError(400, f"seed: must be >= 0, got {req.seed}", param="seed")
        sp.seed = req.seed
    if logprobs is not None:
        sp.logprobs = logprobs
    return sp


def stops(req: SamplingRequest) -> list[str]:
    """``stop`` as a list (OpenAI allows a string or a list)."""
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def chat_messages(messages: Sequence[ChatMessageParam]) -> scheduler_pb2.ChatMessages:
    """OpenAI messages as the scheduler's ``ChatMessages`` (text parts joined; ``developer`` is
    OpenAI's new name for ``system``)."""
    out = scheduler_pb2.ChatMessages()
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise unsupported(f"messages[{i}].content", f"content parts of type {part.type!r}")
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        out.messages.append(scheduler_pb2.ChatMessage(role=role, content=content))
    return out


def chat_logprobs_count(req: ChatCompletionRequest) -> int | None:
    """Chat's ``logprobs``/``top_logprobs`` as the engine's one number (None = no logprobs)."""
    if not req.logprobs:
        if req.top_logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        return None
    return req.top_logprobs or 0


def default_max_tokens(info: ModelInfo, prompt_len: int) -> int:
    """What is left of the context (and of the whole pool) after the prompt: chat's default."""
    room = min(info.max_model_len, (info.num_blocks - 1) * info.block_size) - prompt_len
    if room <= 0:
        raise APIError(400, f"prompt: {prompt_len} tokens leave no room to generate "
                            f"(max_model_len {info.max_model_len})", param="messages")
    return room


def usage(final: scheduler_pb2.GenerateFinal) -> Usage:
    """The final chunk's totals as OpenAI's ``usage`` (cached tokens always present)."""
    return Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                 total_tokens=final.prompt_tokens + final.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=final.cached_tokens))


def finish_reason(final: scheduler_pb2.GenerateFinal) -> str:
    """``stop``, ``length`` or ``abort``."""
    return FINISH_REASONS.get(final.finish_reason, "stop")


def stop_reason(final: scheduler_pb2.GenerateFinal) -> str | None:
    """The stop string or token that ended it (vLLM's ``stop_reason``), None for EOS or length."""
    return final.stop_reason or None


def completion_logprobs(entries: Sequence[common_pb2.SampledLogprobs], tokens: Mapping[int, str],
                        offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs; ``offset`` is the text length before these tokens."""
    out = CompletionLogprobs()
    for e in entries:
        text = tokens[e.sampled.token_id]
        out.tokens.append(text)
        out.token_logprobs.append(e.sampled.logprob)
        out.top_logprobs.append({tokens[t.token_id]: t.logprob for t in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: Sequence[common_pb2.SampledLogprobs], tokens: Mapping[int, str]) -> ChatLogprobs:
    """Chat logprobs: each sampled token with its top alternatives and UTF-8 bytes."""
    def entry(t: common_pb2.TokenLogprob) -> TopLogprob:
        s = tokens[t.token_id]
        return TopLogprob(token=s, logprob=t.logprob, bytes=list(s.encode()))

    return ChatLogprobs(content=[
        ChatLogprob(**entry(e.sampled).model_dump(), top_logprobs=[entry(t) for t in e.top]) for e in entries
    ])


def logprob_token_ids(entries: Sequence[common_pb2.SampledLogprobs]) -> set[int]:
    """Every token id a logprob answer must name."""
    ids = {e.sampled.token_id for e in entries}
    for e in entries:
        ids.update(t.token_id for t in e.top)
    return ids
