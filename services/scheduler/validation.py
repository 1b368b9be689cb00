"""Request validation: every check runs before anything is scheduled, and names the bad field."""

from __future__ import annotations

from collections.abc import Sequence

from services.model_runner.client import RunnerInfo
from services.scheduler.config import SchedulerConfig
from shared.auth import Tenant
from shared.errors import InvalidArgument
from shared.kv_layout import peak_blocks
from shared.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    max_tokens: int,
    info: RunnerInfo,
    config: SchedulerConfig,
) -> None:
    """Raises :class:`InvalidArgument` for the first problem found; returns None when valid.

    NOTE: a request whose prompt plus ``max_tokens`` needs more KV blocks than the whole pool can
    never finish; refusing it here (rather than admitting it and preempting forever) is what keeps
    the step loop free of livelock.
    """
    if len(prompt_token_ids) == 0:
        raise InvalidArgument("prompt: must not be empty")
    if max_tokens <= 0:
        raise InvalidArgument(f"max_tokens: must be > 0, got {max_tokens}")
    if len(prompt_token_ids) > info.max_model_len:
        raise InvalidArgument(
            f"prompt: {len(prompt_token_ids)} tokens exceed max_model_len {info.max_model_len}"
        )
    if len(prompt_token_ids) + max_tokens > info.max_model_len:
        raise InvalidArgument(
            f"max_tokens: prompt ({len(prompt_token_ids)}) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len {info.max_model_len}"
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidArgument(f"prompt: token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
    sampling.validate(info.vocab_size, config.max_logprobs)
    num_tokens = len(prompt_token_ids) + max_tokens
    # A window group holds only its window (plus one step's tokens, plus its sink blocks with
    # attention sinks), a full group every block.
    sinks = info.kv_group_sink_tokens or (0,) * len(info.kv_group_windows)
    blocks = sum(peak_blocks(window, info.block_size, num_tokens, config.max_num_batched_tokens, sink)
                 for window, sink in zip(info.kv_group_windows, sinks, strict=True))
    usable = info.num_blocks - 1
    if blocks > usable:
        raise InvalidArgument(
            f"max_tokens: prompt + max_tokens needs {blocks} KV blocks but the whole pool has {usable}"
        )


def validate_priority(priority: int, tenant: Tenant, default_floor: int) -> None:
    """Refuses a priority below the tenant's floor (lower values run first).

    NOTE: refused rather than clamped, so a client learns its request would not run as asked;
    without a floor any tenant could starve every other by sending a very negative priority.
    """
    floor = tenant.min_priority if tenant.min_priority is not None else default_floor
    if priority < floor:
        raise InvalidArgument(f"priority: {priority} is below this tenant's minimum {floor} (lower runs first)")


def check_bytes(field: str, value: str, limit: int) -> None:
    """Raises :class:`InvalidArgument` naming ``field`` when ``value`` is over ``limit`` UTF-8 bytes.

    NOTE: a character is at least one byte, so a string with more characters than the limit is
    refused without encoding it.
    """
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        raise InvalidArgument(f"{field}: longer than the limit of {limit} bytes")


def prompt_byte_limit(max_model_len: int, config: SchedulerConfig) -> int:
    """Most UTF-8 bytes a text prompt (or all chat contents together) may have."""
    return max_model_len * config.max_bytes_per_token


def validate_string_fields(
    info: RunnerInfo,
    config: SchedulerConfig,
    *,
    request_id: str = "",
    stop: Sequence[str] = (),
    cache_salt: str = "",
    text: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
) -> None:
    """Bounds every string of a public request, before anything tokenizes or copies it.

    Text is bounded by what could ever fit the model (``max_model_len`` tokens of at most
    ``max_bytes_per_token`` bytes each): a longer prompt would be refused after tokenizing anyway,
    so refusing it first costs nothing and keeps a 4 MB prompt from costing seconds and memory.
    """
    check_bytes("request_id", request_id, config.max_request_id_bytes)
    check_bytes("cache_salt", cache_salt, config.max_cache_salt_bytes)
    if len(stop) > config.max_stop_strings:
        raise InvalidArgument(f"stop: {len(stop)} strings exceed the limit of {config.max_stop_strings}")
    for s in stop:
        check_bytes("stop", s, config.max_stop_string_bytes)
    limit = prompt_byte_limit(info.max_model_len, config)
    if text is not None:
        check_bytes("text", text, limit)
    if chat is not None:
        if len(chat) > config.max_chat_messages:
            raise InvalidArgument(
                f"chat.messages: {len(chat)} messages exceed the limit of {config.max_chat_messages}")
        total = 0
        for role, content in chat:
            check_bytes("chat.messages.role", role, 16)
            total += len(content) if len(content) > limit else len(content.encode("utf-8", "surrogatepass"))
            if total > limit:
                raise InvalidArgument(
                    f"chat.messages.content: all messages together are longer than the limit of {limit} bytes")
