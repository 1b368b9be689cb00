"""Metric math on hand-built timings, with the values worked out by hand.

Two successful requests and one failure, duration 2 s:

    A: sent 1.00, chunks at 1.25 1.50 1.75 2.00 (1 token each), prompt 10 (8 cached), 1 preemption
       TTFT 250 ms, E2EL 1000 ms, TPOT 750/3 = 250 ms, ITL 250 250 250
    B: sent 0.00, chunks at 0.50 (1 token) and 1.50 (2 tokens), prompt 20
       TTFT 500 ms, E2EL 1500 ms, TPOT 1000/2 = 500 ms, ITL 1000
    C: failed (not counted in any latency or throughput)
"""

from __future__ import annotations

import pytest

from bench.serve.driver import RequestRecord
from bench.serve.metrics import (
    LatencyStats,
    e2el,
    itls,
    meets_slos,
    output_timeline,
    parse_goodput,
    peak_concurrency,
    percentile,
    summarize,
    tpot,
    ttft,
)
from bench.serve.transports import FinalInfo


def _a() -> RequestRecord:
    return RequestRecord(
        0,
        0,
        prompt_len=10,
        expected_output_len=4,
        send_time=1.0,
        end_time=2.0,
        chunk_times=[1.25, 1.5, 1.75, 2.0],
        chunk_tokens=[1, 1, 1, 1],
        output_token_ids=[5, 6, 7, 8],
        final=FinalInfo(10, 4, 8, 1, "length"),
        success=True,
    )


def _b() -> RequestRecord:
    return RequestRecord(
        1,
        0,
        prompt_len=20,
        expected_output_len=3,
        send_time=0.0,
        end_time=1.5,
        chunk_times=[0.5, 1.5],
        chunk_tokens=[1, 2],
        output_token_ids=[1, 2, 3],
        final=FinalInfo(20, 3, 0, 0, "length"),
        success=True,
    )


def _failed() -> RequestRecord:
    return RequestRecord(
        2, 0, prompt_len=30, expected_output_len=3, send_time=0.0, end_time=0.1, error="Unavailable: boom"
    )


def test_per_request_latencies() -> None:
    a, b = _a(), _b()
    assert ttft(a) == 0.25 and ttft(b) == 0.5
    assert e2el(a) == 1.0 and e2el(b) == 1.5
    assert tpot(a) == 0.25 and tpot(b) == 0.5
    assert itls(a) == [0.25, 0.25, 0.25] and itls(b) == [1.0]
    one = RequestRecord(3, 0, 1, 1, 0.0, 0.5, [0.5], [1], [9], FinalInfo(1, 1, 0, 0, "length"), True)
    assert tpot(one) is None and itls(one) == []


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile(values, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile(values, 100) == 4.0
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_of_hand_built_run() -> None:
    s = summarize([_a(), _b(), _failed()], duration=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (30, 7)
    assert s.request_throughput == 1.0
    assert s.output_throughput == 3.5
    assert s.total_token_throughput == 18.5
    assert s.ttft_ms == LatencyStats(mean=375.0, median=375.0, p90=475.0, p99=497.5)
    assert s.tpot_ms == LatencyStats(mean=375.0, median=375.0, p90=475.0, p99=497.5)
    assert s.e2el_ms == LatencyStats(mean=1250.0, median=1250.0, p90=1450.0, p99=1495.0)
    assert s.itl_ms.mean == 437.5 and s.itl_ms.median == 250.0
    assert s.itl_ms.p90 == pytest.approx(775.0, abs=1e-9)
    assert s.itl_ms.p99 == pytest.approx(977.5, abs=1e-9)
    assert s.cached_tokens == 8
    assert s.prefix_cache_hit_rate == pytest.approx(8 / 30)
    assert s.preemptions == 1
    assert s.peak_concurrency == 2
    assert s.peak_output_throughput == 5.0
    assert s.goodput is None


def test_goodput_counts_requests_within_every_slo() -> None:
    assert parse_goodput(["ttft:300", "tpot:300"]) == {"ttft": 300.0, "tpot": 300.0}
    a, b = _a(), _b()
    assert meets_slos(a, {"ttft": 250.0}) and not meets_slos(b, {"ttft": 250.0})
    assert summarize([a, b], 2.0, {"ttft": 300.0}).goodput == 0.5
    assert summarize([a, b], 2.0, {"ttft": 600.0, "tpot": 300.0}).goodput == 0.5
    assert summarize([a, b], 2.0, {"e2el": 1500.0}).goodput == 1.0
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_timeline_and_concurrency() -> None:
    a, b = _a(), _b()
    assert output_timeline([a, b], 1.0) == [1.0, 5.0, 1.0]
    assert output_timeline([a, b], 0.5) == [0.0, 2.0, 2.0, 8.0, 2.0]
    assert output_timeline([], 1.0) == []
    assert peak_concurrency([a, b]) == 2
    back_to_back = RequestRecord(4, 0, 1, 1, send_time=1.5, end_time=3.0)
    assert peak_concurrency([b, back_to_back]) == 1  # one ends as the other starts


def test_empty_run_is_all_zero() -> None:
    s = summarize([_failed()], duration=0.0)
    assert (s.completed, s.failed, s.output_throughput, s.prefix_cache_hit_rate) == (0, 1, 0.0, 0.0)
    assert s.ttft_ms == LatencyStats(0.0, 0.0, 0.0, 0.0)
