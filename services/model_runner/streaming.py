"""Attention-sinks mode (StreamingLLM): what the runner checks before it serves one.

The mode is server-wide and opt-in (``RunnerConfig.streaming_sinks`` / ``streaming_window``); its
attention is ``attention/streaming.py``, its KV cache group ``shared/kv_layout.with_sinks``, and
docs/kv_layout.md, "Attention sinks (StreamingLLM)", says what it changes.
"""

from __future__ import annotations

from services.model_runner.model.config import ModelConfig
from shared.errors import FailedPrecondition
from shared.kv_layout import KVGroup, with_sinks

# A stream's longest length in attention-sinks mode: the most the APIs' int32 token counts carry
# (the positions the model sees stop at ``k + W - 1``; the KV held stays bounded).
STREAMING_MAX_MODEL_LEN = 2**31 - 1


def check_streaming(config: ModelConfig, backend: str, kv_cache_dtype: str, sink_tokens: int,
                    window: int) -> tuple[KVGroup, ...]:
    """The attention-sinks mode's KV cache groups (every layer, window ``W``, ``k`` sinks), or why not.

    Raises:
        FailedPrecondition: ``k`` or ``W`` not both > 0; a model with sliding-window layers of its
            own; an MLA model (its latent cache has no per-head keys to rotate); a backend other
            than ``torch`` (the only one with the mode's attention); an fp8 or INT4 cache (fp8's
            scales are calibrated on rotated keys; the mode's attention reads plain rows); ``k + W`` beyond the model's
            positions (the cache positions ``0 .. k + W - 1`` must have rotary rows the model
            was trained on).
    """
    if sink_tokens <= 0 or window <= 0:
        raise FailedPrecondition(f"attention sinks need streaming_sinks > 0 and streaming_window > 0 (both set or "
                                 f"neither), got {sink_tokens} and {window}")
    if backend != "torch":
        raise FailedPrecondition(f"attention sinks run on the torch attention backend only, not {backend!r} "
                                 "(set attention_backend to auto or torch)")
    if config.kv_layout != "gqa":
        raise FailedPrecondition(f"attention sinks need per-head K/V; this model's KV layout is {config.kv_layout}")
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype == "int4":
        raise FailedPrecondition(f"attention sinks do not take a {kv_cache_dtype} KV cache (kv_cache_dtype=auto)")
    if sink_tokens + window > config.max_position_embeddings:
        raise FailedPrecondition(f"attention sinks: streaming_sinks + streaming_window = {sink_tokens + window} "
                                 f"exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    try:
        return with_sinks(config.kv_groups, window, sink_tokens)
    except ValueError as e:
        raise FailedPrecondition(str(e)) from e
