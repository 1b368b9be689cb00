"""``kvmesh.v1.Scheduler`` protobuf <-> :mod:`services.scheduler.types`, both directions.

The servicer reads requests and writes responses with these; the Python client
(:mod:`services.scheduler.client`) writes requests and reads responses with the same functions, so
a field added to the proto has one place to be read and one to be written. Messages that carry
only a list of ids (``TokenizeResponse``) or a string (``DetokenizeResponse``) are built in place.
"""

from __future__ import annotations

from services.scheduler.request import FinishReason
from services.scheduler.types import (
    Chunk,
    Final,
    GenerateRequest,
    RequestMetrics,
    SchedulerModelInfo,
)
from shared.convert import logprobs_from_proto, logprobs_to_proto, sampling_from_proto, sampling_to_proto
from shared.pb.kvmesh.v1 import scheduler_pb2

_FINISH_TO_PROTO = {
    FinishReason.STOP: scheduler_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: scheduler_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def chat_to_proto(messages: tuple[tuple[str, str], ...]) -> scheduler_pb2.ChatMessages:
    """``(role, content)`` pairs as ``ChatMessages``."""
    return scheduler_pb2.ChatMessages(messages=[scheduler_pb2.ChatMessage(role=r, content=c) for r, c in messages])


def chat_from_proto(msg: scheduler_pb2.ChatMessages) -> tuple[tuple[str, str], ...]:
    """``ChatMessages`` as ``(role, content)`` pairs."""
    return tuple((m.role, m.content) for m in msg.messages)


def generate_request_to_proto(req: GenerateRequest) -> scheduler_pb2.GenerateRequest:
    """Client side: a request as its message (stop ids and ignore_eos travel beside ``sampling``)."""
    msg = scheduler_pb2.GenerateRequest(
        sampling=sampling_to_proto(req.sampling), max_tokens=req.max_tokens, stop=list(req.stop),
        stop_token_ids=list(req.sampling.stop_token_ids), ignore_eos=req.sampling.ignore_eos,
        request_id=req.request_id, priority=req.priority, cache_salt=req.cache_salt,
        include_special_tokens=req.include_special_tokens,
    )
    if req.text is not None:
        msg.text = req.text
    elif req.chat is not None:
        msg.chat.CopyFrom(chat_to_proto(req.chat))
    elif req.token_ids is not None:
        msg.token_ids.ids.extend(req.token_ids)
    return msg


def generate_request_from_proto(msg: scheduler_pb2.GenerateRequest) -> GenerateRequest:
    """Server side: the message as sent (unvalidated; the servicer checks every field)."""
    kind = msg.WhichOneof("prompt")
    return GenerateRequest(
        text=msg.text if kind == "text" else None,
        chat=chat_from_proto(msg.chat) if kind == "chat" else None,
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        sampling=sampling_from_proto(msg.sampling, msg.stop_token_ids, msg.ignore_eos),
        max_tokens=msg.max_tokens, stop=tuple(msg.stop), request_id=msg.request_id, priority=msg.priority,
        cache_salt=msg.cache_salt, include_special_tokens=msg.include_special_tokens,
    )


def _metrics_to_proto(m: RequestMetrics, final: scheduler_pb2.GenerateFinal) -> None:
    final.prompt_tokens = m.prompt_tokens
    final.completion_tokens = m.completion_tokens
    final.cached_tokens = m.cached_tokens
    final.preemptions = m.preemptions
    final.timing.queue_seconds = m.queue_seconds
    final.timing.ttft_seconds = m.ttft_seconds
    final.timing.tpot_seconds = m.tpot_seconds
    final.timing.e2e_seconds = m.e2e_seconds
    final.timing.max_itl_seconds = m.max_itl_seconds


def _final_from_proto(f: scheduler_pb2.GenerateFinal) -> Final:
    t = f.timing
    return Final(
        finish_reason=_FINISH_FROM_PROTO.get(f.finish_reason, FinishReason.ABORT), stop_reason=f.stop_reason,
        metrics=RequestMetrics(
            prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens, cached_tokens=f.cached_tokens,
            preemptions=f.preemptions, queue_seconds=t.queue_seconds, ttft_seconds=t.ttft_seconds,
            tpot_seconds=t.tpot_seconds, e2e_seconds=t.e2e_seconds, max_itl_seconds=t.max_itl_seconds),
    )


def chunk_to_proto(chunk: Chunk) -> scheduler_pb2.GenerateResponse:
    """Server side: one engine chunk as a stream message."""
    msg = scheduler_pb2.GenerateResponse(
        request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text,
        logprobs=[logprobs_to_proto(lp) for lp in chunk.logprobs if lp is not None],
    )
    if chunk.final is not None:
        msg.final.finish_reason = _FINISH_TO_PROTO[chunk.final.finish_reason]
        msg.final.stop_reason = chunk.final.stop_reason
        if chunk.final.metrics is not None:
            _metrics_to_proto(chunk.final.metrics, msg.final)
    return msg


def chunk_from_proto(msg: scheduler_pb2.GenerateResponse) -> Chunk:
    """Client side: a stream message as a chunk (a chunk with ``final`` ends the stream)."""
    return Chunk(
        request_id=msg.request_id, token_ids=tuple(msg.token_ids), text=msg.text,
        logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
        final=_final_from_proto(msg.final) if msg.HasField("final") else None,
    )


def model_info_to_proto(info: SchedulerModelInfo) -> scheduler_pb2.SchedulerModelInfo:
    """Server side: ``GetModelInfo``'s answer."""
    return scheduler_pb2.SchedulerModelInfo(
        model_id=info.model_id, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
        block_size=info.block_size, num_blocks=info.num_blocks, max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens, max_logprobs=info.max_logprobs,
        has_chat_template=info.has_chat_template, dtype=info.dtype, attention_backend=info.attention_backend,
        dtype_reason=info.dtype_reason, attention_backend_reason=info.attention_backend_reason,
    )


def model_info_from_proto(msg: scheduler_pb2.SchedulerModelInfo) -> SchedulerModelInfo:
    """Client side: ``GetModelInfo``'s answer as the dataclass."""
    return SchedulerModelInfo(
        model_id=msg.model_id, vocab_size=msg.vocab_size, max_model_len=msg.max_model_len,
        block_size=msg.block_size, num_blocks=msg.num_blocks, max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens, max_logprobs=msg.max_logprobs,
        has_chat_template=msg.has_chat_template, dtype=msg.dtype, attention_backend=msg.attention_backend,
        dtype_reason=msg.dtype_reason, attention_backend_reason=msg.attention_backend_reason,
    )
