"""The field's serving metrics, computed from client-side records (the definitions of ``vllm bench serve``).

Per request, from the client clock:

- TTFT = first chunk carrying tokens - send time;
- E2EL = last chunk - send time;
- TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL  = the gaps between successive chunks carrying tokens (a chunk may carry several tokens).

Over the run (``duration`` = first arrival to the last answer): request, output-token and
total-token throughput, goodput (requests per second meeting every given SLO), percentiles
(linear interpolation, as ``numpy.percentile``), and from the servers' final chunks the
prefix-cache hit rate (cached / prompt tokens) and the preemption count. Failed requests count
only as failures.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.serve.driver import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


def ttft(rec: RequestRecord) -> float:
    """Seconds from send to the first token."""
    return rec.chunk_times[0] - rec.send_time


def e2el(rec: RequestRecord) -> float:
    """Seconds from send to the last chunk."""
    return rec.chunk_times[-1] - rec.send_time


def tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first; None with a single output token."""
    if rec.output_len < 2:
        return None
    return (e2el(rec) - ttft(rec)) / (rec.output_len - 1)


def itls(rec: RequestRecord) -> list[float]:
    """Gaps between successive chunks carrying tokens, in seconds."""
    t = rec.chunk_times
    return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile by linear interpolation between closest ranks (0.0 when empty)."""
    if not values:
        return 0.0
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90 and p99 of one latency, in milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        """Statistics of values given in seconds (all zero when there are none)."""
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms) if ms else 0.0
        return cls(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {', '.join(SLO_METRICS)} as NAME:MS, got {item!r}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"goodput SLO {name} must be > 0 ms, got {value}")
        slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a successful request is within every SLO (ms; TPOT of a one-token answer is 0)."""
    values = {"ttft": ttft(rec), "tpot": tpot(rec) or 0.0, "e2el": e2el(rec)}
    return all(values[name] * 1000.0 <= limit for name, limit in slos.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (send to last chunk); an end and a send at the same time do not overlap."""
    events = sorted(
        [(r.send_time, 1) for r in records] + [(r.end_time, -1) for r in records], key=lambda e: (e[0], e[1])
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def output_timeline(records: Sequence[RequestRecord], bin_seconds: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins of ``bin_seconds`` from the start of the run."""
    if bin_seconds <= 0:
        raise ValueError("bin_seconds must be > 0")
    counts: dict[int, int] = {}
    for rec in records:
        for t, n in zip(rec.chunk_times, rec.chunk_tokens, strict=True):
            b = int(t // bin_seconds)
            counts[b] = counts.get(b, 0) + n
    if not counts:
        return []
    return [counts.get(b, 0) / bin_seconds for b in range(max(counts) + 1)]


@dataclass(frozen=True)
class Summary:
    """Everything the report prints."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    peak_concurrency: int
    goodput: float | None
    goodput_slos: Mapping[str, float]
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    cached_tokens: int
    prefix_cache_hit_rate: float
    preemptions: int


def summarize(
    records: Sequence[RequestRecord], duration: float, goodput_slos: Mapping[str, float] | None = None
) -> Summary:
    """The run's summary; throughputs divide by ``duration`` (seconds)."""
    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    tpots = [v for v in (tpot(r) for r in ok) if v is not None]
    finals = [r.final for r in ok if r.final is not None]
    prompt_tokens = sum(f.prompt_tokens for f in finals)
    cached = sum(f.cached_tokens for f in finals)
    per_s = (1.0 / duration) if duration > 0 else 0.0
    slos = dict(goodput_slos or {})
    goodput = sum(meets_slos(r, slos) for r in ok) * per_s if slos else None
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) * per_s,
        output_throughput=n_out * per_s,
        total_token_throughput=(n_in + n_out) * per_s,
        peak_output_throughput=max(output_timeline(ok), default=0.0),
        peak_concurrency=peak_concurrency(ok),
        goodput=goodput,
        goodput_slos=slos,
        ttft_ms=LatencyStats.of_seconds([ttft(r) for r in ok]),
        tpot_ms=LatencyStats.of_seconds(tpots),
        itl_ms=LatencyStats.of_seconds([g for r in ok for g in itls(r)]),
        e2el_ms=LatencyStats.of_seconds([e2el(r) for r in ok]),
        cached_tokens=cached,
        prefix_cache_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        preemptions=sum(f.preemptions for f in finals),
    )
