"""Turning one step's scheduled requests into the flat tensors of a forward pass.

Plain functions of the batch, with no model, so the layout is testable on its own. For each
request, the step computes tokens ``num_computed_tokens .. num_computed_tokens + num_new_tokens``
of its known tokens; they are laid out back to back::

    request:        A (prefill chunk, 3 tokens)   B (decode)
    input_ids:      a4 a5 a6                       b9
    positions:      4  5  6                        9
    query_start_loc 0 ─────────────────────────── 3 ── 4
    seq_lens:       7                              10
    slot_mapping:   block_table[pos // block_size] * block_size + pos % block_size

A request samples only when its scheduled tokens reach the end of its known tokens; a partial
prefill chunk produces K/V and nothing else.

A model with several KV cache groups (``shared/kv_layout.py``) sends one block table per group,
group-major (group 0's table, then group 1's, ..., all of one length); each group gets its own
slots and block tables, the rest is shared. A sliding-window group's table may hold any id, the
null block 0 included, at blocks that lie wholly before the window of the step's first query
(``num_computed_tokens - window + 1``): the kv-cache-manager freed them, and no query of the step
reads them. With attention sinks (StreamingLLM) the group's sink blocks stay live too: only the
middle blocks may be 0, and the table grows past the pool's size over an endless stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.model_runner.attention.base import AttentionMetadata
from shared.errors import InvalidArgument
from shared.kv_layout import dead_blocks, sink_blocks


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as the runner knows it after applying the step's diffs."""

    request_id: str
    token_ids: Sequence[int]  # every token known so far (prompt + outputs)
    block_ids: Sequence[int]  # every group's block table in token order, group after group
    num_computed_tokens: int  # tokens whose K/V are already in the pool
    num_new_tokens: int  # tokens to compute now


@dataclass(frozen=True)
class PoolGeometry:
    """What input preparation validates against."""

    num_blocks: int  # including the null block 0
    block_size: int
    vocab_size: int
    max_model_len: int
    group_windows: tuple[int | None, ...] = (None,)  # per KV cache group its window, None = full
    group_sink_tokens: tuple[int, ...] = ()  # per KV cache group its attention-sink tokens; empty = none

    @property
    def max_blocks_per_seq(self) -> int:
        """Longest block table one sequence can need: ``max_model_len``'s blocks when no group keeps
        every block (attention sinks, or windows in every group: the freed positions stay in the
        table as 0s or stale ids), else also at most the pool's (a full group's blocks all live)."""
        blocks = -(-self.max_model_len // self.block_size)
        if any(self.group_sink_tokens) or all(window is not None for window in self.group_windows):
            return blocks
        return min(blocks, self.num_blocks - 1)

    def sink_blocks(self, group: int) -> int:
        """Leading blocks of ``group`` that are always live (its sink tokens' blocks)."""
        return sink_blocks(self.group_sink_tokens[group], self.block_size) if self.group_sink_tokens else 0


@dataclass(frozen=True)
class BatchInputs:
    """The tensors of one forward pass.

    Attributes:
        input_ids: ``[T]`` int64 token ids of all scheduled tokens.
        positions: ``[T]`` int64 position of each token in its sequence.
        metas: per KV cache group: slots, query ranges, context lengths, padded block tables and
            window (the query ranges and lengths are the same tensors in every group).
        logits_indices: ``[N]`` int64 rows of the hidden states to sample from.
        sampling_requests: for each of those rows, the index of its request in the input order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: tuple[AttentionMetadata, ...]
    logits_indices: torch.Tensor
    sampling_requests: tuple[int, ...]

    @property
    def meta(self) -> AttentionMetadata:
        """Group 0's metadata (the only one of an all-full-attention model)."""
        return self.metas[0]


def validate_request(req: ScheduledRequest, geometry: PoolGeometry) -> None:
    """Raises :class:`InvalidArgument` when ``req``'s counts or block table do not fit the pool.

    Token ids are checked by :func:`check_token_ids`, vectorized, once they are in an array.
    """
    rid = req.request_id
    computed, new = req.num_computed_tokens, req.num_new_tokens
    if computed < 0 or new <= 0:
        raise InvalidArgument(f"{rid}: num_computed_tokens={computed} must be >= 0 and num_new_tokens={new} > 0")
    end = computed + new
    if end > len(req.token_ids):
        raise InvalidArgument(f"{rid}: {computed} computed + {new} new tokens exceed its {len(req.token_ids)} tokens")
    if end > geometry.max_model_len:
        raise InvalidArgument(f"{rid}: {end} tokens exceed max_model_len {geometry.max_model_len}")
    groups = len(geometry.group_windows)
    if len(req.block_ids) % groups:
        raise InvalidArgument(
            f"{rid}: {len(req.block_ids)} block ids do not split into {groups} equal block tables (one per KV "
            "cache group)"
        )
    width = len(req.block_ids) // groups
    if width > geometry.max_blocks_per_seq:
        raise InvalidArgument(
            f"{rid}: block table of {width} blocks exceeds the {geometry.max_blocks_per_seq} one sequence can use"
        )
    needed = -(-end // geometry.block_size)
    if width < needed:
        raise InvalidArgument(f"{rid}: {end} tokens need {needed} blocks of {geometry.block_size}, block table has "
                              f"{width}")  # fmt: skip
    for group, window in enumerate(geometry.group_windows):
        table = req.block_ids[group * width : group * width + needed]
        live = dead_blocks(window, geometry.block_size, computed)
        sinks = geometry.sink_blocks(group)
        for position, block_id in enumerate(table):
            if (position >= live or position < sinks) and not 0 < block_id < geometry.num_blocks:
                where = "" if groups == 1 else f" (KV cache group {group}, block {position})"
                raise InvalidArgument(
                    f"{rid}: block id {block_id}{where} is outside the pool [1, {geometry.num_blocks})"
                )
            if not 0 <= block_id < geometry.num_blocks:
                raise InvalidArgument(f"{rid}: block id {block_id} (KV cache group {group}, block {position}, out of "
                                      f"its window) is outside the pool [0, {geometry.num_blocks})")  # fmt: skip


def extend_tables(request_id: str, tables: Sequence[int], new_ids: Sequence[int], groups: int) -> list[int]:
    """Each group's table of ``tables`` with its run of ``new_ids`` appended (both group-major).

    Raises:
        InvalidArgument: ``new_ids`` does not split into ``groups`` equal runs.
    """
    if groups == 1:
        return [*tables, *new_ids]
    if len(new_ids) % groups:
        raise InvalidArgument(f"{request_id}: {len(new_ids)} new block ids do not split into {groups} equal runs "
                              "(one per KV cache group)")  # fmt: skip
    old, new = len(tables) // groups, len(new_ids) // groups
    return [b for g in range(groups) for b in (*tables[g * old : (g + 1) * old], *new_ids[g * new : (g + 1) * new])]


def check_token_ids(token_ids: np.ndarray, request_id: str, vocab_size: int) -> None:
    """Raises :class:`InvalidArgument` naming the first token id outside ``[0, vocab_size)``."""
    bad = (token_ids < 0) | (token_ids >= vocab_size)
    if bad.any():
        token = int(token_ids[int(bad.argmax())])
        raise InvalidArgument(f"{request_id}: token id {token} is outside the vocabulary [0, {vocab_size})")


def prepare_inputs(
    requests: Sequence[ScheduledRequest], geometry: PoolGeometry, device: torch.device | str = "cpu"
) -> BatchInputs:
    """Validates every request, then lays the step out as flat tensors (see the module docstring).

    Raises:
        InvalidArgument: on the first request that cannot run; nothing is built then.
    """
    if not requests:
        raise InvalidArgument("a step needs at least one scheduled request")
    chunks = []
    for req in requests:
        validate_request(req, geometry)
        end = req.num_computed_tokens + req.num_new_tokens
        chunks.append(np.asarray(req.token_ids[req.num_computed_tokens : end], dtype=np.int64))
        check_token_ids(chunks[-1], req.request_id, geometry.vocab_size)
    bs = geometry.block_size
    computed = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)  # [B]
    q_lens = np.array([r.num_new_tokens for r in requests], dtype=np.int64)  # [B]
    seq_lens = computed + q_lens  # [B]
    query_start_loc = np.concatenate(([0], np.cumsum(q_lens)))  # [B + 1]
    width = int(-(-seq_lens.max() // bs))
    req_of_token = np.repeat(np.arange(len(requests)), q_lens)  # [T]
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[req_of_token] + computed[req_of_token]  # [T]
    input_ids = np.concatenate(chunks)  # [T]
    samples = [i for i, r in enumerate(requests) if int(seq_lens[i]) == len(r.token_ids)]
    logits_indices = query_start_loc[1:][samples] - 1  # [N]

    def to(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    shared_starts, shared_lens = to(query_start_loc, torch.int32), to(seq_lens, torch.int32)
    metas = []
    groups = len(geometry.group_windows)
    for group, window in enumerate(geometry.group_windows):
        block_tables = np.zeros((len(requests), width), dtype=np.int64)  # [B, W], 0 = null block
        for i, r in enumerate(requests):
            n = len(r.block_ids) // groups
            blocks = r.block_ids[group * n : group * n + -(-int(seq_lens[i]) // bs)]
            block_tables[i, : len(blocks)] = blocks
        slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs  # [T]
        metas.append(AttentionMetadata(
            slot_mapping=to(slot_mapping, torch.int64), query_start_loc=shared_starts, seq_lens=shared_lens,
            block_tables=to(block_tables, torch.int32), max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()), window=window,
        ))  # fmt: skip
    return BatchInputs(
        input_ids=to(input_ids, torch.int64),
        positions=to(positions, torch.int64),
        metas=tuple(metas),
        logits_indices=to(logits_indices, torch.int64),
        sampling_requests=tuple(samples),
    )
