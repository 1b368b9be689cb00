"""The public gRPC API: a thin adapter from protobuf to the engine and back."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import grpc

from services.scheduler.auth import current_tenant
from services.scheduler.convert import (
    chat_from_proto,
    chunk_to_proto,
    generate_request_from_proto,
    model_info_to_proto,
)
from services.scheduler.engine import Engine
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.tokenizer import TokenizeGate, Tokenizer
from services.scheduler.tracing import capture_context
from services.scheduler.types import GenerateRequest, SchedulerModelInfo
from services.scheduler.validation import validate_priority, validate_string_fields
from shared.auth import tenant_cache_salt
from shared.errors import InvalidArgument
from shared.grpc_server import ServiceName
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

SERVICE = ServiceName.of("scheduler", scheduler_pb2, "Scheduler")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """``kvmesh.v1.Scheduler``: validation here, everything else in the engine."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tokenize_gate = TokenizeGate(engine.config.max_concurrent_tokenizations,
                                          engine.config.tokenize_wait_seconds)

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidArgument(f"{what}: this deployment has no tokenizer; send token_ids")
        return self.tokenizer

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        kind = request.prompt_kind
        # NOTE: every string is bounded before any of it is tokenized (docs/lifecycle.md).
        validate_string_fields(
            self.engine.info, self.engine.config, request_id=request.request_id, stop=request.stop,
            cache_salt=request.cache_salt, text=request.text, chat=request.chat)
        if request.text is not None:
            tok = self._require_tokenizer("text")
            with self.tokenize_gate.slot():
                return tok.encode(request.text)
        if request.chat is not None:
            if not request.chat:
                raise InvalidArgument("prompt: chat.messages must not be empty")
            tok = self._require_tokenizer("chat")
            with self.tokenize_gate.slot():
                return tok.apply_chat_template(request.chat)
        if kind == "token_ids":
            return list(request.token_ids or ())
        raise InvalidArgument("prompt: one of text, chat or token_ids is required")

    def Generate(self, message: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[scheduler_pb2.GenerateResponse]:
        tenant = current_tenant()
        request = generate_request_from_proto(message)
        validate_priority(request.priority, tenant, self.engine.config.min_priority)
        prompt = self._prompt_ids(request)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e8 else None
        spec = build_spec(
            self.engine, prompt, request.sampling, request.max_tokens, stop=request.stop,
            request_id=request.request_id, priority=request.priority, cache_salt=request.cache_salt,
            deadline=deadline, trace_context=capture_context(),
        )
        # The tenant's salt is derived here, never taken from the client (docs/security.md).
        spec = dataclasses.replace(spec, cache_salt=tenant_cache_salt(
            self.engine.config.deployment_key, tenant.id, spec.cache_salt))
        stream = OutputStream(self.engine, spec, self.tokenizer, request.include_special_tokens)
        context.add_callback(stream.cancel)
        for chunk in stream:
            yield chunk_to_proto(chunk)

    def Tokenize(self, request: scheduler_pb2.TokenizeRequest, context: grpc.ServicerContext
                 ) -> scheduler_pb2.TokenizeResponse:
        tok = self._require_tokenizer("text")
        kind = request.WhichOneof("input")
        msgs = chat_from_proto(request.chat) if kind == "chat" else None
        validate_string_fields(self.engine.info, self.engine.config,
                               text=request.text if kind == "text" else None, chat=msgs)
        if kind == "chat":
            assert msgs is not None
            with self.tokenize_gate.slot():
                ids = tok.apply_chat_template(msgs)
        elif kind == "text":
            with self.tokenize_gate.slot():
                ids = tok.encode(request.text, add_special_tokens=request.add_special_tokens)
        else:
            raise InvalidArgument("input: text or chat is required")
        return scheduler_pb2.TokenizeResponse(token_ids=ids)

    def Detokenize(self, request: scheduler_pb2.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> scheduler_pb2.DetokenizeResponse:
        tok = self._require_tokenizer("token_ids")
        vocab, max_len = self.engine.info.vocab_size, self.engine.info.max_model_len
        if len(request.token_ids) > max_len:
            raise InvalidArgument(f"token_ids: {len(request.token_ids)} ids exceed max_model_len {max_len}")
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token_ids: {bad[0]} is outside the vocabulary [0, {vocab})")
        return scheduler_pb2.DetokenizeResponse(
            text=tok.decode(request.token_ids, skip_special_tokens=not request.include_special_tokens))

    def GetModelInfo(self, request: scheduler_pb2.SchedulerModelInfoRequest, context: grpc.ServicerContext
                     ) -> scheduler_pb2.SchedulerModelInfo:
        info, cfg = self.engine.info, self.engine.config
        return model_info_to_proto(SchedulerModelInfo(
            model_id=info.model_id, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            block_size=info.block_size, num_blocks=info.num_blocks, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_logprobs=cfg.max_logprobs,
            has_chat_template=self.tokenizer is not None and self.tokenizer.has_chat_template,
            dtype=info.dtype, attention_backend=info.attention_backend, dtype_reason=info.dtype_reason,
            attention_backend_reason=info.attention_backend_reason,
        ))
