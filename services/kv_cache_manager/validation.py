"""Up-front validation of a whole step, so that bad input raises before anything changes.

Running out of blocks is not an error (it is an allocation outcome); everything here is a
caller bug: unknown or duplicate ids, negative counts, tokens out of range, scheduling tokens
that are not known yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.kv_cache_manager.request import RequestState
from services.kv_cache_manager.types import AllocationSpec
from shared.errors import AlreadyExists, InvalidArgument, NotFound

# Token ids travel as int32 in the proto and are hashed as int32 (shared.hashing).
MAX_TOKEN_ID = 2**31 - 1


def validate_token_ids(token_ids: Sequence[int], what: str) -> None:
    """Token ids must fit the int32 encoding and be non-negative."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
        raise InvalidArgument(f"{what}: token ids must be in [0, {MAX_TOKEN_ID}]")


def validate_free(requests: Mapping[str, RequestState], request_ids: Sequence[str]) -> None:
    """Each id must be live and named once."""
    if len(set(request_ids)) != len(request_ids):
        raise InvalidArgument("free_request_ids contains duplicates")
    for request_id in request_ids:
        if request_id not in requests:
            raise NotFound(f"request {request_id!r} is not live")


def validate_step(requests: Mapping[str, RequestState], free_request_ids: Sequence[str],
                  allocations: Sequence[AllocationSpec], max_model_len: int) -> None:
    """Raises InvalidArgument / NotFound / AlreadyExists for the first bad part of a step.

    Frees are applied before allocations, so a request freed in this step may come back in
    the same step as a new one (preemption by recompute).
    """
    validate_free(requests, free_request_ids)
    freed = set(free_request_ids)
    seen: set[str] = set()
    for spec in allocations:
        rid = spec.request_id
        if not rid:
            raise InvalidArgument("request_id must not be empty")
        if rid in seen:
            raise InvalidArgument(f"request {rid!r} appears twice in one step")
        seen.add(rid)
        if spec.num_new_tokens < 0:
            raise InvalidArgument(f"request {rid!r}: num_new_tokens must be >= 0")
        if spec.num_external_blocks < 0:
            raise InvalidArgument(f"request {rid!r}: num_external_blocks must be >= 0")
        validate_token_ids(spec.new_token_ids, f"request {rid!r}")
        live = rid in requests and rid not in freed
        if spec.is_new:
            if live:
                raise AlreadyExists(f"request {rid!r} is already live")
            num_tokens = len(spec.new_token_ids)
            if num_tokens == 0:
                raise InvalidArgument(f"request {rid!r}: a new request needs at least one token")
        else:
            if not live:
                raise NotFound(f"request {rid!r} is not live (send is_new for a new request)")
            state = requests[rid]
            num_tokens = state.num_tokens + len(spec.new_token_ids)
            if state.num_computed_tokens + spec.num_new_tokens > num_tokens:
                raise InvalidArgument(
                    f"request {rid!r}: {state.num_computed_tokens} computed + {spec.num_new_tokens} new"
                    f" tokens exceed the {num_tokens} known tokens")
        if num_tokens > max_model_len:
            raise InvalidArgument(f"request {rid!r}: {num_tokens} tokens exceed max_model_len {max_model_len}")
