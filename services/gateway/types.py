"""The gateway's API types: OpenAI's request and response bodies (pydantic), its error, and the
scheduler port the core talks to.

Requests ignore fields they do not know (as vLLM does: SDKs and frameworks send extras), but every
OpenAI field that changes the answer and that the engine cannot honour is declared here, so the
core can refuse it with a 400 that names it instead of silently ignoring it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from shared.pb.kvmesh.v1 import scheduler_pb2


class APIError(Exception):
    """An error as OpenAI returns it: HTTP status plus ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's SDKs parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UpstreamError(Exception):
    """A failed scheduler call, described without grpc types (``code`` is the status name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler serves (fetched once; the gateway holds nothing else)."""

    model_id: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_logprobs: int
    has_chat_template: bool


@dataclass(frozen=True)
class CallContext:
    """Per-request facts forwarded to the scheduler."""

    request_id: str
    authorization: str | None = None
    metadata: tuple[tuple[str, str], ...] = field(default_factory=tuple)


class SchedulerAPI(Protocol):
    """The scheduler as the core sees it (``client.SchedulerClient`` is the gRPC adapter)."""

    async def model_info(self, ctx: CallContext | None = None) -> ModelInfo: ...

    def generate(self, request: scheduler_pb2.GenerateRequest, ctx: CallContext,
                 timeout: float | None) -> AsyncIterator[scheduler_pb2.GenerateResponse]: ...

    async def tokenize(self, request: scheduler_pb2.TokenizeRequest, ctx: CallContext) -> list[int]: ...

    async def detokenize(self, token_ids: list[int], ctx: CallContext) -> str: ...

    async def healthy(self, timeout: float) -> bool: ...


# ---------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    """``stream_options``: whether a last chunk carries ``usage``."""

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields common to both endpoints (OpenAI's, plus vLLM's extensions the engine has)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    """One part of a message's content list."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageParam(BaseModel):
    """One message of ``messages``."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a prompt or chat messages."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """How much of the prompt the prefix cache served."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or of one streamed chunk)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of it (same ``object`` name, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """One alternative token of a chat logprob entry."""

    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    """One sampled token of a chat answer with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per output token."""

    content: list[ChatLogprob] = Field(default_factory=list)


class ChatMessage(BaseModel):
    """The assistant's answer (or one streamed delta of it)."""

    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
