"""The scheduler's client: kvmesh's public API from Python (wraps the generated ``Scheduler`` stub).

    with KVMeshClient(DEFAULT_ADDRESS) as client:
        for chunk in client.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)

With authentication on, pass ``api_key=`` (sent as ``authorization: Bearer <key>`` metadata on
every call); with TLS, ``tls=TLSFiles(ca=...)`` (see docs/security.md). :class:`AsyncKVMeshClient`
is the same API for asyncio programs (``grpc.aio``), built from the same request builder, which
writes the message with the servicer's own converter (``services.scheduler.convert``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from services.scheduler.config import DEFAULT_ADDRESS
from services.scheduler.convert import generate_request_to_proto
from services.scheduler.types import GenerateRequest
from shared.channels import open_aio_channel, open_channel
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.sampling_params import SamplingParams
from shared.tls import TLSFiles

__all__ = ["DEFAULT_ADDRESS", "AsyncKVMeshClient", "KVMeshClient"]


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class KVMeshClient:
    """Streaming generation, tokenization and model info over one channel."""

    def __init__(self, address: str, api_key: str | None = None, tls: TLSFiles | None = None) -> None:
        self.channel = open_channel(address, tls=tls)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> KVMeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | Sequence[int] | Sequence[tuple[str, str]],
        max_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        include_special_tokens: bool = False,
    ) -> scheduler_pb2.GenerateRequest:
        """Builds a ``GenerateRequest``: ``prompt`` is text, token ids, or ``(role, content)`` pairs.

        Every sampling field of the API is here (``None`` = the server's default); the server
        validates them (``INVALID_ARGUMENT`` naming the field).
        """
        sampling = SamplingParams(
            temperature=temperature, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, logprobs=logprobs, stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos, top_p=1.0 if top_p is None else top_p,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty)
        if isinstance(prompt, str):
            kind: dict[str, Any] = {"text": prompt}
        elif prompt and isinstance(prompt[0], tuple):
            kind = {"chat": tuple((str(r), str(c)) for r, c in prompt)}  # type: ignore[misc]
        else:
            kind = {"token_ids": tuple(int(t) for t in prompt)}  # type: ignore[arg-type]
        return generate_request_to_proto(GenerateRequest(
            **kind, sampling=sampling, max_tokens=max_tokens, stop=tuple(stop), request_id=request_id,
            priority=priority, cache_salt=cache_salt, include_special_tokens=include_special_tokens))

    def generate(self, prompt: Any, max_tokens: int = 64, timeout: float | None = None,
                 **kwargs: Any) -> Iterator[scheduler_pb2.GenerateResponse]:
        """Streams chunks; the last one carries ``final``. Cancel by closing the iterator."""
        call = self.stub.Generate(self.request(prompt, max_tokens, **kwargs), timeout=timeout,
                                 metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: Any, max_tokens: int = 64, **kwargs: Any) -> tuple[str, list[int], Any]:
        """Non-streaming convenience: (text, token ids, final info)."""
        text: list[str] = []
        ids: list[int] = []
        final = None
        for chunk in self.generate(prompt, max_tokens, **kwargs):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            if chunk.HasField("final"):
                final = chunk.final
        return "".join(text), ids, final

    def model_info(self) -> scheduler_pb2.SchedulerModelInfo:
        """What the suite serves."""
        return self.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), metadata=self.metadata)

    def tokenize(self, text: str) -> list[int]:
        """Text to token ids with the served tokenizer."""
        return list(self.stub.Tokenize(scheduler_pb2.TokenizeRequest(text=text),
                                       metadata=self.metadata).token_ids)


class AsyncKVMeshClient:
    """:class:`KVMeshClient` for asyncio: ``async for chunk in client.generate(...)``.

    NOTE: a separate class over ``grpc.aio`` rather than threads around the sync client, so a
    program with thousands of concurrent streams holds no thread per stream.
    """

    def __init__(self, address: str, api_key: str | None = None, tls: TLSFiles | None = None) -> None:
        self.channel = open_aio_channel(address, tls=tls)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    async def close(self) -> None:
        """Closes the channel."""
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncKVMeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(self, prompt: Any, max_tokens: int = 64, timeout: float | None = None,
                       **kwargs: Any) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """Streams chunks; the last one carries ``final``. Leaving the loop early cancels the request."""
        call = self.stub.Generate(KVMeshClient.request(prompt, max_tokens, **kwargs), timeout=timeout,
                                  metadata=self.metadata)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def complete(self, prompt: Any, max_tokens: int = 64, **kwargs: Any) -> tuple[str, list[int], Any]:
        """Non-streaming convenience: (text, token ids, final info)."""
        text: list[str] = []
        ids: list[int] = []
        final = None
        async for chunk in self.generate(prompt, max_tokens, **kwargs):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            if chunk.HasField("final"):
                final = chunk.final
        return "".join(text), ids, final

    async def model_info(self) -> scheduler_pb2.SchedulerModelInfo:
        """What the suite serves."""
        return await self.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), metadata=self.metadata)

    async def tokenize(self, text: str) -> list[int]:
        """Text to token ids with the served tokenizer."""
        resp = await self.stub.Tokenize(scheduler_pb2.TokenizeRequest(text=text), metadata=self.metadata)
        return list(resp.token_ids)
