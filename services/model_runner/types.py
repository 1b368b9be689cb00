"""Plain data of the model-runner's API: what it serves and one step (no grpc, no protobuf).

Mirrors ``ExecuteRequest`` / ``ExecuteResponse`` in ``proto/kvmesh/v1/model_runner.proto``:
a new request is described once in full; afterwards only diffs travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_params import SampledLogprobs, SamplingParams, TokenLogprob

__all__ = ["SampledLogprobs", "TokenLogprob"]  # the runner's API names them; shared owns them


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled for the first time (or again after preemption)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt, then earlier outputs after a preemption
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # K/V already in the pool (prefix hit)
    num_new_tokens: int  # tokens to compute in this step
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner knows: what changed since its previous step."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_new_tokens: int


@dataclass(frozen=True)
class StepInput:
    """One scheduler step."""

    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    cached_requests: tuple[CachedRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    # Nonzero: planned before step ``after_step_id`` returned, from what that step will leave
    # behind (async scheduling); it must run right after that step and only if that step ran.
    after_step_id: int = 0


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request in a step."""

    request_id: str
    token_id: int
    logprobs: SampledLogprobs | None = None


@dataclass(frozen=True)
class StepOutput:
    """Tokens sampled in one step: one per request whose scheduled tokens reached its end."""

    step_id: int
    sampled: tuple[SampledToken, ...]
    forward_seconds: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What the runner serves (mirrors the ``ModelInfo`` proto message)."""

    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int  # -1 if none
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str
    attention_backend: str
    bytes_per_block: int
    device: str
    dtype_reason: str = ""  # why this dtype (``factory.select_dtype``)
    attention_backend_reason: str = ""  # why this backend (``factory.select_backend``)
    pool_id: str = ""  # the pool's incarnation (its handle's generation, new at every start)
    # per KV cache group its sliding window, None = full attention (``shared/kv_layout.py``);
    # block ids travel group-major: every group's table, one after another, all of one length
    kv_group_windows: tuple[int | None, ...] = (None,)
    # the KV layout: "gqa" (K and V per KV head; num_kv_heads x head_dim per plane) or "mla" (one
    # plane of latent + rotary key: num_kv_heads 1, head_dim = kv_lora_rank + qk_rope_head_dim)
    kv_layout: str = "gqa"
    kv_bytes_per_token: float = 0.0  # across all layers, shared/kv_layout.py's formula
    # per KV cache group its attention-sink tokens (StreamingLLM mode, docs/kv_layout.md); empty = none
    kv_group_sink_tokens: tuple[int, ...] = ()
