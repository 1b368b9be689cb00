"""A small Python client for kvmesh's public API (wraps the generated ``Scheduler`` stub).

    with KVMeshClient("127.0.0.1:50051") as client:
        for chunk in client.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)

With authentication on, pass ``api_key=`` (sent as ``authorization: Bearer <key>`` metadata on
every call); with TLS, ``tls=TLSFiles(ca=...)`` (see docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from shared.channels import open_channel
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.tls import TLSFiles


class KVMeshClient:
    """Streaming generation, tokenization and model info over one channel."""

    def __init__(self, address: str, api_key: str | None = None, tls: TLSFiles | None = None) -> None:
        self.channel = open_channel(address, tls=tls)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()

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
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
    ) -> scheduler_pb2.GenerateRequest:
        """Builds a ``GenerateRequest``: ``prompt`` is text, token ids, or ``(role, content)`` pairs."""
        sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k)
        if top_p is not None:
            sampling.top_p = top_p
        if seed is not None:
            sampling.seed = seed
        if logprobs is not None:
            sampling.logprobs = logprobs
        req = scheduler_pb2.GenerateRequest(
            sampling=sampling, max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos, request_id=request_id, priority=priority, cache_salt=cache_salt,
        )
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], tuple):
            req.chat.messages.extend(scheduler_pb2.ChatMessage(role=r, content=c) for r, c in prompt)  # type: ignore[misc]
        else:
            req.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
        return req

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
