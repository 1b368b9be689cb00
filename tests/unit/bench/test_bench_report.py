"""The report keeps ``vllm bench serve``'s layout; the JSON holds every request."""

from __future__ import annotations

import json

from bench.serve.driver import RequestRecord
from bench.serve.metrics import summarize
from bench.serve.report import format_summary, result_json
from bench.serve.transports import FinalInfo


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(
            0,
            0,
            10,
            4,
            send_time=1.0,
            end_time=2.0,
            chunk_times=[1.25, 1.5, 1.75, 2.0],
            chunk_tokens=[1, 1, 1, 1],
            output_token_ids=[5, 6, 7, 8],
            final=FinalInfo(10, 4, 8, 1, "length"),
            success=True,
        )
    ]


def test_block_layout_matches_vllm() -> None:
    lines = format_summary(summarize(_records(), 2.0)).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert lines[1] == "Successful requests:                     1"
    assert "Benchmark duration (s):                  2.00" in lines
    assert "Output token throughput (tok/s):         2.00" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "----------------End-to-end Latency----------------" in lines
    assert "Mean TTFT (ms):                          250.00" in lines
    assert "P90 E2EL (ms):                           1000.00" in lines
    assert "Prefix cache hit rate (%):               80.00" in lines
    assert "Preemptions:                             1" in lines
    assert all(len(line) == 50 for line in lines if line[:1] in "=-")
    assert all(line == line.rstrip() for line in lines)
    labels = [line.split(":")[0] for line in lines if ":" in line]
    order = [
        "Successful requests",
        "Failed requests",
        "Benchmark duration (s)",
        "Total input tokens",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Output token throughput (tok/s)",
    ]
    assert labels[: len(order)] == order
    assert not any(line.startswith("Request goodput") for line in lines)


def test_goodput_line_only_with_slos() -> None:
    text = format_summary(summarize(_records(), 2.0, {"ttft": 300.0}))
    assert "Request goodput (req/s):                 0.50" in text.splitlines()


def test_result_json_has_config_summary_and_requests() -> None:
    records = _records()
    data = json.loads(json.dumps(result_json(summarize(records, 2.0), records, {"dataset": "random"})))
    assert data["config"] == {"dataset": "random"}
    assert data["summary"]["ttft_ms"]["mean"] == 250.0
    assert data["requests"][0]["chunk_times"] == [1.25, 1.5, 1.75, 2.0]
    assert data["requests"][0]["final"]["cached_tokens"] == 8


def test_result_json_has_vllms_flat_keys_with_their_values() -> None:
    records = _records()
    records.append(RequestRecord(1, 0, 12, 4, send_time=1.5, end_time=1.6, error="RuntimeError: HTTP 503"))
    data = json.loads(json.dumps(result_json(summarize(records, 2.0, {"ttft": 300.0}), records,
                                             {"backend": "openai", "model_id": "m", "date": "20261201-130000",
                                              "driver": {"request_rate": "inf", "max_concurrency": 4}})))
    assert (data["date"], data["backend"], data["model_id"]) == ("20261201-130000", "openai", "m")
    assert (data["num_prompts"], data["completed"], data["failed"], data["duration"]) == (2, 1, 1, 2.0)
    assert (data["request_rate"], data["max_concurrency"]) == ("inf", 4)
    assert data["total_input_tokens"] == 10 and data["total_output_tokens"] == 4
    assert data["request_throughput"] == 0.5 and data["output_throughput"] == 2.0
    assert data["request_goodput"] == 0.5  # TTFT 250 ms meets the 300 ms SLO
    assert data["ttfts"] == [0.25, 0.0] and data["itls"] == [[0.25, 0.25, 0.25], []]
    assert data["errors"] == ["", "RuntimeError: HTTP 503"]
    assert data["input_lens"] == [10, 12] and data["output_lens"] == [4, 0]
    assert data["mean_ttft_ms"] == 250.0 and data["median_ttft_ms"] == 250.0 and data["std_ttft_ms"] == 0.0
    assert data["p99_ttft_ms"] == 250.0 and data["mean_e2el_ms"] == 1000.0
    assert data["mean_tpot_ms"] == 250.0 and data["mean_itl_ms"] == 250.0 and data["std_itl_ms"] == 0.0
    assert "max_output_tokens_per_s" in data and data["max_concurrent_requests"] == 1
    assert data["kvmesh"] == {"prefix_cache_hit_rate": 0.8, "cached_tokens": 8, "preemptions": 1}
