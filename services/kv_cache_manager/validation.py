"""Up-front validation of a whole step, so that bad input raises before anything changes.

Running out of blocks is not an error (it is an allocation outcome); everything here is a
caller bug: unknown or duplicate ids, negative counts, tokens out of range, scheduling tokens
that are not known yet, block hashes of the wrong size or number (the scheduler sends them; a
step must bring a hash for every block it completes, and none for a block that is not full).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.kv_cache_manager.request import RequestState
from services.kv_cache_manager.types import AllocationSpec
from shared.errors import AlreadyExists, InvalidArgument, NotFound
from shared.hashing import HASH_BYTES

# Token ids travel as int32 in the proto and are hashed as int32 (shared.hashing).
MAX_TOKEN_ID = 2**31 - 1


def validate_token_ids(token_ids: Sequence[int], what: str) -> None:
    """Token ids must fit the int32 encoding and be non-negative."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
        raise InvalidArgument(f"{what}: token ids must be in [0, {MAX_TOKEN_ID}]")


def validate_hashes(block_hashes: Sequence[bytes], what: str) -> None:
    """Every hash must be a whole SHA-256 digest (shared.hashing): the prefix map's keys."""
    for i, block_hash in enumerate(block_hashes):
        if len(block_hash) != HASH_BYTES:
            raise InvalidArgument(f"{what}: block hash {i} is {len(block_hash)} bytes, not {HASH_BYTES}")


def _check_hash_count(rid: str, num_hashes: int, num_tokens: int, num_required: int, block_size: int) -> None:
    num_full = num_tokens // block_size
    if num_hashes > num_full:
        raise InvalidArgument(f"request {rid!r}: {num_hashes} block hashes for {num_full} full blocks")
    if num_hashes < num_required:
        raise InvalidArgument(f"request {rid!r}: {num_hashes} block hashes, but this step can complete "
                              f"{num_required} blocks, each registered by its hash")


def validate_free(requests: Mapping[str, RequestState], request_ids: Sequence[str]) -> None:
    """Each id must be live and named once."""
    if len(set(request_ids)) != len(request_ids):
        raise InvalidArgument("free_request_ids contains duplicates")
    for request_id in request_ids:
        if request_id not in requests:
            raise NotFound(f"request {request_id!r} is not live")


def validate_step(requests: Mapping[str, RequestState], free_request_ids: Sequence[str],
                  allocations: Sequence[AllocationSpec], max_model_len: int, block_size: int,
                  has_windows: bool = False) -> None:
    """Raises InvalidArgument / NotFound / AlreadyExists for the first bad part of a step.

    Frees are applied before allocations, so a request freed in this step may come back in
    the same step as a new one (preemption by recompute).

    ``has_windows``: some KV cache group slides a window; external (offload-store) blocks are then
    refused, since they name blocks by their leading-prefix hashes, one KV per hash, and a window
    group's KV is neither leading nor kept (docs/design.md, "Block tables per group (kv-cache-manager)").

    NOTE: a new request's prefix hit is only known while the step runs (an earlier allocation of
    the same step may register blocks), so its hashes are checked against the most the step can
    complete: the hashes it sent (or its external blocks) as a hit, plus ``num_new_tokens``.
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
        if not 0 <= spec.num_lookahead_tokens <= max_model_len:
            raise InvalidArgument(f"request {rid!r}: num_lookahead_tokens must be in [0, {max_model_len}]")
        if spec.num_external_blocks and has_windows:
            raise InvalidArgument(f"request {rid!r}: external blocks need a model without sliding-window "
                                  "groups (the offload tier is off for it)")
        validate_token_ids(spec.new_token_ids, f"request {rid!r}")
        validate_hashes(spec.block_hashes, f"request {rid!r}")
        live = rid in requests and rid not in freed
        num_hashes = len(spec.block_hashes)
        if spec.is_new:
            if live:
                raise AlreadyExists(f"request {rid!r} is already live")
            num_tokens = len(spec.new_token_ids)
            if num_tokens == 0:
                raise InvalidArgument(f"request {rid!r}: a new request needs at least one token")
            max_cached = (num_tokens - 1) // block_size
            most_known = max(min(num_hashes, max_cached), min(spec.num_external_blocks, max_cached))
            end = min(most_known * block_size + spec.num_new_tokens, num_tokens)
            _check_hash_count(rid, num_hashes, num_tokens, end // block_size, block_size)
        else:
            if not live:
                raise NotFound(f"request {rid!r} is not live (send is_new for a new request)")
            state = requests[rid]
            num_tokens = state.num_tokens + len(spec.new_token_ids)
            if state.num_computed_tokens + spec.num_new_tokens > num_tokens:
                raise InvalidArgument(
                    f"request {rid!r}: {state.num_computed_tokens} computed + {spec.num_new_tokens} new"
                    f" tokens exceed the {num_tokens} known tokens")
            end = state.num_computed_tokens + spec.num_new_tokens
            _check_hash_count(rid, len(state.block_hashes) + num_hashes, num_tokens, end // block_size,
                              block_size)
        if num_tokens > max_model_len:
            raise InvalidArgument(f"request {rid!r}: {num_tokens} tokens exceed max_model_len {max_model_len}")
