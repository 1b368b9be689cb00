"""Runs a workload through a transport and records what the client saw of every request.

One thread per in-flight conversation (a thread pool sized to the concurrency cap, or to the
number of conversations when uncapped): a conversation is submitted at its arrival offset, waits
for a free worker if the cap is reached (the pool *is* the semaphore), then sends its turns one
after the other, each turn's prompt being the previous prompt + the previous answer + new user
tokens. All times are ``time.perf_counter()`` seconds since the run started, taken in this process,
so they include the transport (gRPC, serialization) exactly as a user would see it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from bench.serve.arrivals import arrival_offsets
from bench.serve.datasets import Conversation, num_requests
from bench.serve.transports import FinalInfo, Transport, WireRequest


@dataclass
class RequestRecord:
    """One request as the client saw it.

    ``chunk_times[i]`` is when the ``i``-th chunk carrying tokens arrived and ``chunk_tokens[i]``
    how many tokens it carried; TTFT, ITL and TPOT all derive from these (see ``metrics.py``).
    """

    conversation_id: int
    turn: int
    prompt_len: int
    expected_output_len: int
    send_time: float
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    final: FinalInfo | None = None
    success: bool = False
    error: str = ""

    @property
    def output_len(self) -> int:
        """Tokens received."""
        return len(self.output_token_ids)


@dataclass(frozen=True)
class DriverConfig:
    """How requests are offered: arrival rate, concurrency cap, seed of the arrival process."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class BenchRun:
    """Every record and the wall-clock duration of the whole run (first arrival to last answer)."""

    records: list[RequestRecord]
    duration: float


Clock = Callable[[], float]


class Driver:
    """Sends a workload through one transport (reusable for repeats)."""

    def __init__(self, transport: Transport, config: DriverConfig, clock: Clock = time.perf_counter) -> None:
        self.transport = transport
        self.config = config
        self.clock = clock

    def run(self, conversations: Sequence[Conversation]) -> BenchRun:
        """Runs every conversation to its end; failures are recorded, never raised."""
        n = len(conversations)
        offsets = arrival_offsets(n, self.config.request_rate, self.config.seed)
        workers = max(1, min(n, self.config.max_concurrency or n))
        records: list[list[RequestRecord]] = [[] for _ in range(n)]
        bar = tqdm(
            total=num_requests(conversations),
            file=sys.stderr,
            disable=not self.config.progress,
            desc="bench",
            unit="req",
            dynamic_ncols=True,
        )
        lock = threading.Lock()

        def tick() -> None:
            with lock:
                bar.update(1)

        start = self.clock()
        with ThreadPoolExecutor(workers, thread_name_prefix="bench") as pool:
            futures = []
            for i, (conv, offset) in enumerate(zip(conversations, offsets, strict=True)):
                delay = start + offset - self.clock()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(self._conversation, conv, start, records[i], tick))
            for f in futures:
                f.result()
        duration = self.clock() - start
        bar.close()
        return BenchRun([r for conv in records for r in conv], duration)

    def _conversation(
        self, conv: Conversation, start: float, out: list[RequestRecord], tick: Callable[[], None]
    ) -> None:
        history: list[int] = []
        failed = ""
        for turn_index, turn in enumerate(conv.turns):
            prompt = (*history, *turn.user_token_ids)
            if failed:
                out.append(
                    RequestRecord(
                        conv.conversation_id,
                        turn_index,
                        len(prompt),
                        turn.output_len,
                        self.clock() - start,
                        self.clock() - start,
                        error=failed,
                    )
                )
                tick()
                continue
            rec = self._request(
                WireRequest(prompt, turn.output_len, conv.cache_salt), start, conv.conversation_id, turn_index
            )
            out.append(rec)
            tick()
            if not rec.success:
                failed = f"an earlier turn failed: {rec.error}"
            history = [*prompt, *rec.output_token_ids]

    def _request(self, req: WireRequest, start: float, conversation_id: int, turn: int) -> RequestRecord:
        rec = RequestRecord(
            conversation_id, turn, len(req.prompt_token_ids), req.max_tokens, send_time=self.clock() - start
        )
        try:
            for event in self.transport.stream(req):
                now = self.clock() - start
                if event.token_ids:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(len(event.token_ids))
                    rec.output_token_ids.extend(event.token_ids)
                if event.final is not None:
                    rec.final = event.final
            rec.success = rec.final is not None and rec.output_len > 0
            if not rec.success:
                rec.error = "stream ended without a final chunk" if rec.final is None else "no tokens"
        except Exception as exc:  # NOTE: a benchmark reports failures, it does not stop on them
            rec.error = f"{type(exc).__name__}: {_short(exc)}"
        rec.end_time = self.clock() - start
        return rec


def _short(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return str(text).splitlines()[0][:200] if text else ""
