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
    """The public API through :class:`shared.client.KVMeshClient` (one channel, many streams)."""

    def __init__(self, address: str) -> None:
        from shared.client import KVMeshClient

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
