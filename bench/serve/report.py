"""The result as users of ``vllm bench serve`` know it, and as JSON for ``--save-result``.

The text block keeps vLLM's labels, widths (40-character labels, 50-character rules) and order, so
results can be read (and diffed) side by side with vLLM's; kvmesh adds the percentiles p90 and a
"KV cache" section (prefix-cache hit rate, preemptions) from the servers' final chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from bench.serve import metrics
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


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (``numpy.std``, as vLLM computes it)."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return float((sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5)


def vllm_keys(summary: Summary, records: Sequence[RequestRecord], config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat keys ``vllm bench serve --save-result`` writes, so tools made for its files read ours.

    Latencies in milliseconds (``mean_/median_/std_/p99_<metric>_ms``), ``ttfts`` and ``itls`` in
    seconds per request, ``errors`` one string per request ("" when it succeeded).
    """
    ok = [r for r in records if r.success]
    samples = {
        "ttft": [metrics.ttft(r) for r in ok],
        "tpot": [v for v in (metrics.tpot(r) for r in ok) if v is not None],
        "itl": [g for r in ok for g in metrics.itls(r)],
        "e2el": [metrics.e2el(r) for r in ok],
    }
    out: dict[str, Any] = {
        "date": config.get("date", ""),
        "backend": config.get("backend", "grpc"),
        "model_id": config.get("model_id", ""),
        "num_prompts": len(records),
        "request_rate": config.get("driver", {}).get("request_rate", "inf"),
        "max_concurrency": config.get("driver", {}).get("max_concurrency"),
        "duration": summary.duration_s,
        "completed": summary.completed,
        "failed": summary.failed,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "max_output_tokens_per_s": summary.peak_output_throughput,
        "max_concurrent_requests": summary.peak_concurrency,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [metrics.ttft(r) if r.success else 0.0 for r in records],
        "itls": [metrics.itls(r) if r.success else [] for r in records],
        "errors": [r.error for r in records],
    }
    if summary.goodput is not None:
        out["request_goodput"] = summary.goodput
    for name, values in samples.items():
        stats = LatencyStats.of_seconds(values)
        out[f"mean_{name}_ms"] = stats.mean
        out[f"median_{name}_ms"] = stats.median
        out[f"std_{name}_ms"] = _std([v * 1000.0 for v in values])
        out[f"p90_{name}_ms"] = stats.p90
        out[f"p99_{name}_ms"] = stats.p99
    return out


def result_json(summary: Summary, records: Sequence[RequestRecord], config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``--save-result`` writes: vLLM's flat keys, then kvmesh's KV section, the run's
    configuration, the summary and every request (extra keys vLLM's readers ignore)."""
    return {
        **vllm_keys(summary, records, config),
        "kvmesh": {"prefix_cache_hit_rate": summary.prefix_cache_hit_rate, "cached_tokens": summary.cached_tokens,
                   "preemptions": summary.preemptions},
        "config": dict(config),
        "summary": dataclasses.asdict(summary),
        "requests": [dataclasses.asdict(r) for r in records],
    }
