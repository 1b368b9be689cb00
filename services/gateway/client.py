"""The scheduler's public gRPC API as the gateway uses it (``grpc.aio``, one channel).

Every grpc detail stays here: calls carry the caller's ``authorization`` and ``x-request-id`` as
metadata (keys are checked in the scheduler, one place for both protocols), and failures leave as
:class:`UpstreamError` with the status name, so the core never imports grpc.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.types import CallContext, ModelInfo, UpstreamError
from shared.channels import open_aio_channel
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.tls import TLSFiles


def _metadata(ctx: CallContext | None) -> tuple[tuple[str, str | bytes], ...]:
    if ctx is None:
        return ()
    md: list[tuple[str, str | bytes]] = [("x-request-id", ctx.request_id), *ctx.metadata]
    if ctx.authorization:
        md.append(("authorization", ctx.authorization))
    return tuple(md)


def _upstream(exc: grpc.aio.AioRpcError) -> UpstreamError:
    return UpstreamError(exc.code().name, exc.details() or exc.code().name)


class SchedulerClient:
    """The gRPC adapter behind :class:`services.gateway.types.SchedulerAPI`."""

    def __init__(self, address: str, tls: TLSFiles | None = None) -> None:
        self.address = address
        self.tls = tls or TLSFiles()
        self._channel: grpc.aio.Channel | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        # NOTE: created lazily so it binds to the event loop uvicorn runs, not the importing one.
        # The same options and TLS rules as every other kvmesh channel (shared/channels.py), on aio.
        if self._channel is None:
            self._channel = open_aio_channel(self.address, tls=self.tls)
        return self._channel

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerAsyncStub:
        stub: scheduler_pb2_grpc.SchedulerAsyncStub = scheduler_pb2_grpc.SchedulerStub(self.channel)  # type: ignore[assignment]
        return stub

    async def close(self) -> None:
        """Closes the channel (in-flight calls are cancelled)."""
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def model_info(self, ctx: CallContext | None = None) -> ModelInfo:
        try:
            info = await self.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(),
                                                metadata=_metadata(ctx), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from None
        return ModelInfo(model_id=info.model_id, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                         block_size=info.block_size, num_blocks=info.num_blocks, max_logprobs=info.max_logprobs,
                         has_chat_template=info.has_chat_template)

    async def generate(self, request: scheduler_pb2.GenerateRequest, ctx: CallContext,
                       timeout: float | None) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """Streams the scheduler's chunks; closing this generator cancels the call (frees blocks)."""
        call = self.stub.Generate(request, metadata=_metadata(ctx), timeout=timeout)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from None
        finally:
            call.cancel()

    async def tokenize(self, request: scheduler_pb2.TokenizeRequest, ctx: CallContext) -> list[int]:
        try:
            resp = await self.stub.Tokenize(request, metadata=_metadata(ctx), timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from None
        return list(resp.token_ids)

    async def detokenize(self, token_ids: list[int], ctx: CallContext) -> str:
        try:
            resp = await self.stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=token_ids),
                                              metadata=_metadata(ctx), timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from None
        return resp.text

    async def healthy(self, timeout: float) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
