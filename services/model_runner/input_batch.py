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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any

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

    @cached_property
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


def _count_error(requests: Sequence[ScheduledRequest], computed: np.ndarray, new: np.ndarray, known: np.ndarray,
                 table_lens: np.ndarray, geometry: PoolGeometry) -> tuple[int, str] | None:
    """``(index, message)`` of the first request whose counts or table length do not fit the pool
    (checked for the whole batch at once: one numpy op per rule, not a Python loop per request)."""
    groups = len(geometry.group_windows)
    end = computed + new
    width = table_lens // groups
    needed = -(-end // geometry.block_size)
    rules: tuple[tuple[np.ndarray, Callable[[int], str]], ...] = (
        ((computed < 0) | (new <= 0),
         lambda i: f"num_computed_tokens={computed[i]} must be >= 0 and num_new_tokens={new[i]} > 0"),
        (end > known, lambda i: f"{computed[i]} computed + {new[i]} new tokens exceed its {known[i]} tokens"),
        (end > geometry.max_model_len, lambda i: f"{end[i]} tokens exceed max_model_len {geometry.max_model_len}"),
        (table_lens % groups != 0,
         lambda i: f"{table_lens[i]} block ids do not split into {groups} equal block tables (one per KV cache "
                   "group)"),
        (width > geometry.max_blocks_per_seq,
         lambda i: f"block table of {width[i]} blocks exceeds the {geometry.max_blocks_per_seq} one sequence can use"),
        (width < needed,
         lambda i: f"{end[i]} tokens need {needed[i]} blocks of {geometry.block_size}, block table has {width[i]}"),
    )  # fmt: skip
    bad = rules[0][0]
    for mask, _ in rules[1:]:
        bad = bad | mask
    if not bad.any():
        return None
    i = int(bad.argmax())
    message = next(text(i) for mask, text in rules if mask[i])
    return i, f"{requests[i].request_id}: {message}"


def _block_error(requests: Sequence[ScheduledRequest], table: np.ndarray, in_table: np.ndarray, group: int,
                 computed: np.ndarray, geometry: PoolGeometry) -> tuple[int, str] | None:
    """``(index, message)`` of the first request whose ``group`` table ``[B, W]`` (``in_table``: the
    positions its context needs) holds an id outside the pool: outside ``[1, num_blocks)`` at a
    live block (in or after the window of the step's first query, or a sink block), outside
    ``[0, num_blocks)`` at a dead one (the kv-cache-manager freed it: the null block is fine)."""
    window, num_blocks = geometry.group_windows[group], geometry.num_blocks
    bad_live = bad = in_table & ((table < 1) | (table >= num_blocks))  # a full group: every block is live
    if window is not None:
        dead = np.array([dead_blocks(window, geometry.block_size, c) for c in computed.tolist()], dtype=np.int64)
        position = np.arange(table.shape[1])
        bad_live = bad & ((position >= dead[:, None]) | (position < geometry.sink_blocks(group)))
        bad = bad_live | (in_table & ((table < 0) | (table >= num_blocks)))
    if not bad.any():
        return None
    i, p = (int(x) for x in np.unravel_index(int(bad.argmax()), bad.shape))
    rid, block_id = requests[i].request_id, int(table[i, p])
    if bad_live[i, p]:
        where = "" if len(geometry.group_windows) == 1 else f" (KV cache group {group}, block {p})"
        return i, f"{rid}: block id {block_id}{where} is outside the pool [1, {num_blocks})"
    return i, (f"{rid}: block id {block_id} (KV cache group {group}, block {p}, out of its window) is outside the "
               f"pool [0, {num_blocks})")  # fmt: skip


def extend_tables(request_id: str, tables: list[int], new_ids: Sequence[int], groups: int) -> list[int]:
    """Each group's table of ``tables`` with its run of ``new_ids`` appended (both group-major): a
    new list, or ``tables`` itself when there is nothing to append (most decode steps; lists of
    block ids are never changed in place).

    Raises:
        InvalidArgument: ``new_ids`` does not split into ``groups`` equal runs.
    """
    if not new_ids:
        return tables
    if groups == 1:
        return [*tables, *new_ids]
    if len(new_ids) % groups:
        raise InvalidArgument(f"{request_id}: {len(new_ids)} new block ids do not split into {groups} equal runs "
                              "(one per KV cache group)")  # fmt: skip
    old, new = len(tables) // groups, len(new_ids) // groups
    return [b for g in range(groups) for b in (*tables[g * old : (g + 1) * old], *new_ids[g * new : (g + 1) * new])]


def check_token_ids(token_ids: np.ndarray, request_id: str, vocab_size: int) -> None:
    """Raises :class:`InvalidArgument` naming the first token id outside ``[0, vocab_size)``."""
    error = _token_error(token_ids, request_id, vocab_size)
    if error is not None:
        raise InvalidArgument(error)


def _token_error(token_ids: np.ndarray, request_id: str, vocab_size: int) -> str | None:
    bad = _bad_tokens(token_ids, vocab_size)
    if not bad.any():
        return None
    token = int(token_ids[int(bad.argmax())])
    return f"{request_id}: token id {token} is outside the vocabulary [0, {vocab_size})"


def _bad_tokens(token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    return (token_ids < 0) | (token_ids >= vocab_size)


def prepare_inputs(
    requests: Sequence[ScheduledRequest], geometry: PoolGeometry, device: torch.device | str = "cpu"
) -> BatchInputs:
    """Validates every request, then lays the step out as flat tensors (see the module docstring).

    Every rule is checked for the whole batch at once, in numpy; the error names the first request
    in step order that breaks one (its counts, then its block tables group by group, then its
    token ids).

    Raises:
        InvalidArgument: on the first request that cannot run; nothing is built then.
    """
    if not requests:
        raise InvalidArgument("a step needs at least one scheduled request")
    n, bs, groups = len(requests), geometry.block_size, len(geometry.group_windows)
    computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, n)  # [B]
    q_lens = np.fromiter((r.num_new_tokens for r in requests), np.int64, n)  # [B]
    known = np.fromiter((len(r.token_ids) for r in requests), np.int64, n)  # [B]
    table_lens = np.fromiter((len(r.block_ids) for r in requests), np.int64, n)  # [B]
    counts = _count_error(requests, computed, q_lens, known, table_lens, geometry)
    if counts is not None:
        # NOTE: an earlier request's table or token error comes first, as it does in step order.
        if counts[0]:
            prepare_inputs(requests[: counts[0]], geometry, device)
        raise InvalidArgument(counts[1])
    seq_lens = computed + q_lens  # [B]
    query_start_loc = np.zeros(n + 1, dtype=np.int64)  # [B + 1]
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    needed = -(-seq_lens // bs)  # [B] blocks of each context
    width = int(needed.max())
    req_of_token = np.repeat(np.arange(n), q_lens)  # [T]
    positions = np.arange(num_tokens) - query_start_loc[req_of_token] + computed[req_of_token]  # [T]
    input_ids = np.fromiter(chain.from_iterable(
        r.token_ids[c:e] for r, c, e in zip(requests, computed.tolist(), seq_lens.tolist(), strict=True)
    ), np.int64, num_tokens)  # [T]  # fmt: skip
    # Every request's block ids back to back; group g of request i starts at its offset + g * its width.
    all_ids = np.fromiter(chain.from_iterable(r.block_ids for r in requests), np.int64, int(table_lens.sum()))
    offsets = np.cumsum(table_lens) - table_lens  # [B]
    column = np.arange(width)
    in_table = column < needed[:, None]  # [B, W] positions each context uses
    tables = []
    errors = []
    for group in range(groups):
        index = (offsets + group * (table_lens // groups))[:, None] + column  # [B, W]
        table = np.where(in_table, all_ids[np.minimum(index, len(all_ids) - 1)], 0)  # [B, W], 0 = null block
        tables.append(table)
        errors.append(_block_error(requests, table, in_table, group, computed, geometry))
    bad_token = _bad_tokens(input_ids, geometry.vocab_size)  # [T]
    if bad_token.any():
        i = int(req_of_token[int(bad_token.argmax())])
        chunk = input_ids[query_start_loc[i] : query_start_loc[i + 1]]
        errors.append((i, str(_token_error(chunk, requests[i].request_id, geometry.vocab_size))))
    found = [e for e in errors if e is not None]
    if found:
        raise InvalidArgument(min(found, key=lambda e: e[0])[1])  # NOTE: min keeps the first of equal indices
    sampling = (seq_lens == known).nonzero()[0]  # requests whose scheduled tokens reach their last token
    logits_indices = query_start_loc[1:][sampling] - 1  # [N]

    on_cpu = torch.device(device).type == "cpu"

    def to(array: np.ndarray, dtype: type[np.signedinteger[Any]]) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
        return tensor if on_cpu else tensor.to(device)

    shared_starts, shared_lens = to(query_start_loc, np.int32), to(seq_lens, np.int32)
    max_query_len, max_seq_len = int(q_lens.max()), int(seq_lens.max())
    block_of_token, offset_in_block = positions // bs, positions % bs
    metas = tuple(AttentionMetadata(
        slot_mapping=to(table[req_of_token, block_of_token] * bs + offset_in_block, np.int64),  # [T]
        query_start_loc=shared_starts, seq_lens=shared_lens, block_tables=to(table, np.int32),
        max_query_len=max_query_len, max_seq_len=max_seq_len, window=window,
    ) for table, window in zip(tables, geometry.group_windows, strict=True))  # fmt: skip
    return BatchInputs(
        input_ids=to(input_ids, np.int64),
        positions=to(positions, np.int64),
        metas=metas,
        logits_indices=to(logits_indices, np.int64),
        sampling_requests=tuple(sampling.tolist()),
    )
