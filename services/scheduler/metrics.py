"""Per-request latency metrics, derived in one place from a request's timestamps.

TTFT = first token - arrival; TPOT = (last token - first token) / (output tokens - 1);
ITL = gaps between successive tokens (the largest is kept per request); queue = first
scheduling - arrival. Exported in each stream's final chunk, and (later) as Prometheus metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.scheduler.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    """Final figures of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    queue_seconds: float
    ttft_seconds: float
    tpot_seconds: float
    e2e_seconds: float
    max_itl_seconds: float

    @classmethod
    def of(cls, req: Request, completion_tokens: int | None = None, now: float | None = None) -> RequestMetrics:
        """Metrics of ``req`` as it stands (``completion_tokens`` overrides the count, e.g. after
        a stop string truncated the output)."""
        t = req.times
        now = time.monotonic() if now is None else now
        n = len(req.output_token_ids) if completion_tokens is None else completion_tokens
        first = t.first_token
        last = t.last_token if t.last_token is not None else now
        return cls(
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=n,
            cached_tokens=max(req.num_cached_tokens, 0),
            preemptions=req.num_preemptions,
            queue_seconds=(t.first_scheduled - t.arrival) if t.first_scheduled is not None else now - t.arrival,
            ttft_seconds=(first - t.arrival) if first is not None else 0.0,
            tpot_seconds=((last - first) / (n - 1)) if first is not None and n > 1 else 0.0,
            e2e_seconds=last - t.arrival,
            max_itl_seconds=t.max_itl,
        )
