"""Protobuf <-> the model-runner's dataclasses (types.py), both sides of every RPC.

Runner side (``servicer.py``): ``step_from_proto``, ``output_to_proto``, ``model_info_to_proto``.
Scheduler side (``client.py``): the other direction. The pool handle's message is
``shared.tensor_handle``'s (the offload-store maps it too).
"""

from __future__ import annotations

from services.model_runner.types import (
    CachedRequestData,
    ModelInfo,
    NewRequestData,
    SampledToken,
    StepInput,
    StepOutput,
)
from shared.convert import logprobs_from_proto, logprobs_to_proto, sampling_from_proto, sampling_to_proto
from shared.pb.kvmesh.v1 import model_runner_pb2


def model_info_to_proto(mi: ModelInfo) -> model_runner_pb2.ModelInfo:
    """Runner side: what it serves."""
    return model_runner_pb2.ModelInfo(
        model_id=mi.model_id, architecture=mi.architecture, vocab_size=mi.vocab_size,
        max_model_len=mi.max_model_len, eos_token_ids=list(mi.eos_token_ids), num_blocks=mi.num_blocks,
        block_size=mi.block_size, num_layers=mi.num_layers, num_kv_heads=mi.num_kv_heads,
        head_dim=mi.head_dim, dtype=mi.dtype, kv_cache_dtype=mi.kv_cache_dtype,
        attention_backend=mi.attention_backend, bytes_per_block=mi.bytes_per_block, device=mi.device,
        bos_token_id=mi.bos_token_id, dtype_reason=mi.dtype_reason,
        attention_backend_reason=mi.attention_backend_reason, pool_id=mi.pool_id,
        kv_group_windows=[window or 0 for window in mi.kv_group_windows],
        kv_layout=mi.kv_layout, kv_bytes_per_token=mi.kv_bytes_per_token,
        kv_group_sink_tokens=list(mi.kv_group_sink_tokens),
    )


def model_info_from_proto(msg: model_runner_pb2.ModelInfo) -> ModelInfo:
    """Scheduler side: what the runner serves."""
    return ModelInfo(
        model_id=msg.model_id, architecture=msg.architecture, vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len, eos_token_ids=tuple(msg.eos_token_ids), bos_token_id=msg.bos_token_id,
        num_blocks=msg.num_blocks, block_size=msg.block_size, num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, dtype=msg.dtype, kv_cache_dtype=msg.kv_cache_dtype,
        attention_backend=msg.attention_backend, bytes_per_block=msg.bytes_per_block, device=msg.device,
        dtype_reason=msg.dtype_reason, attention_backend_reason=msg.attention_backend_reason, pool_id=msg.pool_id,
        kv_group_windows=tuple(window or None for window in msg.kv_group_windows) or (None,),
        kv_layout=msg.kv_layout or "gqa", kv_bytes_per_token=msg.kv_bytes_per_token,
        kv_group_sink_tokens=tuple(msg.kv_group_sink_tokens) if any(msg.kv_group_sink_tokens) else (),
    )


def step_to_proto(step: StepInput) -> model_runner_pb2.ExecuteRequest:
    """Scheduler side: a planned step as an RPC message."""
    return model_runner_pb2.ExecuteRequest(
        step_id=step.step_id,
        new_requests=[
            model_runner_pb2.NewRequestData(
                request_id=r.request_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_new_tokens=r.num_new_tokens,
                sampling=sampling_to_proto(r.sampling),
            )
            for r in step.new_requests
        ],
        cached_requests=[
            model_runner_pb2.CachedRequestData(
                request_id=r.request_id,
                new_block_ids=r.new_block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_new_tokens=r.num_new_tokens,
            )
            for r in step.cached_requests
        ],
        finished_request_ids=step.finished_request_ids,
        after_step_id=step.after_step_id,
    )


def step_from_proto(msg: model_runner_pb2.ExecuteRequest) -> StepInput:
    """Runner side: an RPC message as a step."""
    return StepInput(
        step_id=msg.step_id,
        new_requests=tuple(
            NewRequestData(
                request_id=r.request_id,
                token_ids=tuple(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                block_ids=tuple(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_new_tokens=r.num_new_tokens,
                sampling=sampling_from_proto(r.sampling),
            )
            for r in msg.new_requests
        ),
        cached_requests=tuple(
            CachedRequestData(
                request_id=r.request_id,
                new_block_ids=tuple(r.new_block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_new_tokens=r.num_new_tokens,
            )
            for r in msg.cached_requests
        ),
        finished_request_ids=tuple(msg.finished_request_ids),
        after_step_id=msg.after_step_id,
    )


def output_to_proto(out: StepOutput) -> model_runner_pb2.ExecuteResponse:
    """Runner side: sampled tokens as an RPC message."""
    return model_runner_pb2.ExecuteResponse(
        step_id=out.step_id,
        sampled=[
            model_runner_pb2.SampledToken(
                request_id=s.request_id, token_id=s.token_id,
                logprobs=logprobs_to_proto(s.logprobs) if s.logprobs is not None else None,
            )
            for s in out.sampled
        ],
        forward_seconds=out.forward_seconds,
    )


def output_from_proto(msg: model_runner_pb2.ExecuteResponse) -> StepOutput:
    """Scheduler side: an RPC message as sampled tokens."""
    return StepOutput(
        step_id=msg.step_id,
        sampled=tuple(
            SampledToken(
                request_id=s.request_id,
                token_id=s.token_id,
                logprobs=logprobs_from_proto(s.logprobs) if s.HasField("logprobs") else None,
            )
            for s in msg.sampled
        ),
        forward_seconds=msg.forward_seconds,
    )
