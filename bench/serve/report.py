"""The result as users of ``vllm bench serve`` know it, and as JSON for ``--save-result``.

The text block keeps vLLM's labels, widths (40-character labels, 50-character rules) and order, so
results can be read (and diffed) side by side with vLLM's; kvmesh adds the percentiles p90 and a
"KV cache" section (prefix-cache hit rate, preemptions) from the servers' final chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from bench.serve.driver import RequestRecord
from bench.serve.metrics import LatencyStats, Summary

WIDTH = 50
_SECTIONS = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}"


def _line(label: str, value: float | int, digits: int = 2) -> str:
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    # NOTE: vLLM pads values to 10 characters; the padding is stripped so saved text has no trailing spaces.
    return f"{label:<40} {text}"


def _latency(short: str, stats: LatencyStats) -> list[str]:
    return [
        _line(f"Mean {short} (ms):", stats.mean),
        _line(f"Median {short} (ms):", stats.median),
        _line(f"P90 {short} (ms):", stats.p90),
        _line(f"P99 {short} (ms):", stats.p99),
    ]


def format_summary(s: Summary) -> str:
    """The ``============ Serving Benchmark Result ============`` block."""
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _line("Successful requests:", s.completed),
        _line("Failed requests:", s.failed),
        _line("Benchmark duration (s):", s.duration_s),
        _line("Total input tokens:", s.total_input_tokens),
        _line("Total generated tokens:", s.total_output_tokens),
        _line("Request throughput (req/s):", s.request_throughput),
    ]
    if s.goodput is not None:
        lines.append(_line("Request goodput (req/s):", s.goodput))
    lines += [
        _line("Output token throughput (tok/s):", s.output_throughput),
        _line("Peak output token throughput (tok/s):", s.peak_output_throughput),
        _line("Peak concurrent requests:", s.peak_concurrency),
        _line("Total Token throughput (tok/s):", s.total_token_throughput),
    ]
    for attr, short, title in _SECTIONS:
        lines.append(_rule(title, "-"))
        lines += _latency(short, getattr(s, attr))
    lines += [
        _rule("KV cache", "-"),
        _line("Prefix cache hit rate (%):", s.prefix_cache_hit_rate * 100.0),
        _line("Cached prompt tokens:", s.cached_tokens),
        _line("Preemptions:", s.preemptions),
        "=" * WIDTH,
    ]
    return "\n".join(lines)


def result_json(summary: Summary, records: Sequence[RequestRecord], config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``--save-result`` writes: the run's configuration, the summary and every request."""
    return {
        "config": dict(config),
        "summary": dataclasses.asdict(summary),
        "requests": [dataclasses.asdict(r) for r in records],
    }
