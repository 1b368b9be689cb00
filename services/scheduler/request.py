"""A request's state inside the scheduler: tokens, progress, blocks, timing.

There is no prefill or decode phase: a request has ``num_tokens`` (prompt + output so far) and
``num_computed_tokens`` (K/V in the pool); each step computes some of the difference.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.hashing import BlockHash
from shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended (mirrors the proto's FinishReason)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class RequestSpec:
    """A validated request as the scheduler receives it (no protobuf)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    priority: int = 0
    cache_salt: bytes = b""
    deadline: float | None = None  # time.monotonic() value after which the request is aborted
    trace_context: Any = None  # OpenTelemetry context of the Generate span (None: untraced)


@dataclass
class RequestTimes:
    """Timestamps (``time.monotonic()``) from which TTFT, TPOT, ITL and queue time derive."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    max_itl: float = 0.0
    last_gap: float | None = None  # the gap the latest token closed (None for the first token)

    def on_token(self, now: float) -> None:
        """Records one output token's arrival."""
        self.last_gap = None
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.last_gap = now - self.last_token
            self.max_itl = max(self.max_itl, self.last_gap)
        self.last_token = now


@dataclass
class Request:
    """Mutable scheduler-side state of one request."""

    spec: RequestSpec
    seq: int  # arrival order, the tie-breaker after priority
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # One block table per KV cache group (the kv-cache-manager's, as it handed them out). A window
    # group's table keeps the ids of blocks that slid out of the window: the manager reused them,
    # and neither this copy nor the runner's ever reads a position outside the window.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_tokens_sent_to_kvm: int = 0  # tokens the kv-cache-manager knows of this request
    # Tokens computed in steps sent ahead (async scheduling: slots the manager had handed out
    # already, so no allocation was asked): the manager learns of them with the next allocation.
    num_unreported_tokens: int = 0
    # Full blocks' chained hashes, computed once here (the scheduler owns the seed): the
    # kv-cache-manager's prefix keys and the offload-store's keys.
    block_hashes: list[BlockHash] = field(default_factory=list)
    known_to_runner: bool = False
    num_cached_tokens: int = -1  # prompt tokens from the prefix cache at first scheduling
    num_preemptions: int = 0
    in_admission_queue: bool = True  # counted against the waiting-queue bounds
    num_steps: int = 0  # steps the request took part in (for step-span sampling)
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrival=time.monotonic()))

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.spec.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens."""
        return [*self.spec.prompt_token_ids, *self.output_token_ids]

    def token_ids_from(self, start: int) -> list[int]:
        """Tokens from index ``start`` on (without building the whole list when possible)."""
        n_prompt = len(self.spec.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt :]
        return [*self.spec.prompt_token_ids[start:], *self.output_token_ids]

    @property
    def block_ids(self) -> list[int]:
        """Every group's table, group-major (a copy): how block ids travel to the runner."""
        return [block_id for table in self.block_tables for block_id in table]

    def forget_placement(self) -> None:
        """Preempted or re-bound: no peer holds its KV or knows it any more (its tokens and hashes
        stay: recomputing them gives the same answer)."""
        self.known_to_runner = False
        self.num_computed_tokens = 0
        self.num_tokens_sent_to_kvm = 0
        self.num_unreported_tokens = 0
        self.block_tables = [[] for _ in self.block_tables]

    @property
    def trace_context(self) -> Any:
        """The request's trace context, if it is traced."""
        return self.spec.trace_context

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: lower priority value first, then arrival."""
        return (self.spec.priority, self.seq)

    def at_length(self, max_model_len: int, more: int = 0) -> bool:
        """Whether the request is at its length limit (``max_tokens`` or ``max_model_len``) once
        ``more`` tokens are appended: the one rule the stop check (``more=0``, after appending)
        and async scheduling (``more=1``, before the token is known) both read."""
        return (len(self.output_token_ids) + more >= self.spec.max_tokens
                or self.num_tokens + more >= max_model_len)

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended."""
        return self.status is RequestStatus.FINISHED
