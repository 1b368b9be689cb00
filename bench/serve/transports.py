"""How one request is streamed: over the public gRPC API, or straight into an in-process engine.

The driver measures both through this one small interface with the same client-side clock, so the
difference between the two numbers is what the gRPC split costs and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.scheduler.inprocess import InProcessSuite


@dataclass(frozen=True)
class FinalInfo:
    """The server's totals for one request (``GenerateFinal``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    finish_reason: str


@dataclass(frozen=True)
class StreamEvent:
    """One chunk as the client saw it: new token ids, and the totals on the last one."""

    token_ids: tuple[int, ...]
    final: FinalInfo | None = None


@dataclass(frozen=True)
class WireRequest:
    """What the driver asks for: greedy, exact output length."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str = ""
    request_id: str = ""


class Transport(Protocol):
    """Streams one request; safe to call from many threads at once."""

    def stream(self, request: WireRequest) -> Iterator[StreamEvent]:
        """Yields chunks as they arrive; raises on failure."""
        ...


class GrpcTransport:
    """The public API through :class:`services.scheduler.client.KVMeshClient` (one channel, many streams)."""

    def __init__(self, address: str) -> None:
        from services.scheduler.client import KVMeshClient

        self.client = KVMeshClient(address)

    def stream(self, request: WireRequest) -> Iterator[StreamEvent]:
        """One ``Generate`` stream: greedy, ``ignore_eos``, ``max_tokens`` = the output length."""
        for chunk in self.client.generate(
            list(request.prompt_token_ids),
            request.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            cache_salt=request.cache_salt,
            request_id=request.request_id,
        ):
            final = None
            if chunk.HasField("final"):
                f = chunk.final
                final = FinalInfo(
                    f.prompt_tokens, f.completion_tokens, f.cached_tokens, f.preemptions, _proto_reason(f.finish_reason)
                )
            yield StreamEvent(tuple(chunk.token_ids), final)

    def close(self) -> None:
        """Closes the channel."""
        self.client.close()


def _proto_reason(value: int) -> str:
    from shared.pb.kvmesh.v1 import scheduler_pb2

    name: str = scheduler_pb2.FinishReason.Name(value)  # type: ignore[arg-type]
    return name.removeprefix("FINISH_REASON_").lower()


class InProcessTransport:
    """The same engine without gRPC: ``build_spec`` + ``OutputStream`` (no detokenization).

    NOTE: the gRPC servicer detokenizes every chunk; here the tokenizer is skipped (token ids are
    all the benchmark reads), which slightly favours the in-process number.
    """

    def __init__(self, suite: InProcessSuite) -> None:
        self.suite = suite

    def stream(self, request: WireRequest) -> Iterator[StreamEvent]:
        """One request through the engine's output queue."""
        from services.scheduler.stream import OutputStream, build_spec
        from shared.sampling_params import SamplingParams

        engine = self.suite.engine
        spec = build_spec(
            engine,
            request.prompt_token_ids,
            SamplingParams(temperature=0.0, ignore_eos=True),
            request.max_tokens,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
        )
        out = OutputStream(engine, spec, None)
        try:
            for chunk in out:
                final = None
                if chunk.final is not None:
                    m = chunk.final.metrics
                    final = FinalInfo(
                        m.prompt_tokens if m else len(request.prompt_token_ids),
                        m.completion_tokens if m else 0,
                        m.cached_tokens if m else 0,
                        m.preemptions if m else 0,
                        chunk.final.finish_reason.value,
                    )
                yield StreamEvent(chunk.token_ids, final)
        finally:
            out.cancel()


@dataclass(frozen=True)
class ServerInfo:
    """What the benchmark needs to know of the server before building the workload."""

    model_id: str
    vocab_size: int
    max_model_len: int


class OpenAITransport:
    """Any OpenAI-compatible server (kvmesh's gateway, vLLM, SGLang) through streaming
    ``POST /v1/completions`` with token-id prompts, as ``vllm bench serve --backend openai`` does.

    Sends ``ignore_eos`` and ``cache_salt`` (vLLM's extensions, kvmesh's too) and asks for
    ``return_token_ids``, so chunks carry their token ids; a server without that extension is
    counted one token per chunk (vLLM's own fallback), with placeholder ids.
    """

    def __init__(self, base_url: str, model: str = "", api_key: str = "", vocab_size: int = 0) -> None:
        import httpx  # the dev extra; only this backend needs it

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=None, limits=limits)
        self._model = model
        self._vocab_size = vocab_size

    def info(self) -> ServerInfo:
        """The served model from ``GET /v1/models`` (its ``vocab_size`` unless given)."""
        resp = self.http.get("/v1/models")
        resp.raise_for_status()
        card = resp.json()["data"][0]
        if not self._model:
            self._model = card["id"]
        vocab = self._vocab_size or int(card.get("vocab_size", 0))
        if not vocab:
            raise ValueError("the server's /v1/models has no vocab_size: pass --vocab-size")
        return ServerInfo(self._model, vocab, int(card.get("max_model_len", 0)) or 1 << 30)

    def stream(self, request: WireRequest) -> Iterator[StreamEvent]:
        """One streamed completion: greedy, ``ignore_eos``, ``max_tokens`` = the output length."""
        import json

        body = {
            "model": self._model, "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "return_token_ids": True,
        }
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        headers = {"X-Request-Id": request.request_id} if request.request_id else {}
        finish = "stop"
        with self.http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "error event"))
                usage = event.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                    yield StreamEvent((), FinalInfo(usage["prompt_tokens"], usage["completion_tokens"], cached, 0,
                                                    finish))
                    continue
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids")
                    if ids is None:
                        ids = [0] if choice.get("text") else []
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    if ids:
                        yield StreamEvent(tuple(ids))

    def close(self) -> None:
        """Closes the connection pool."""
        self.http.close()
