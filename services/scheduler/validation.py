"""Request validation: every check runs before anything is scheduled, and names the bad field."""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.scheduler.backends import RunnerInfo
from services.scheduler.config import SchedulerConfig
from shared.auth import Tenant
from shared.errors import InvalidArgument
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
    blocks = math.ceil((len(prompt_token_ids) + max_tokens) / info.block_size)
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
