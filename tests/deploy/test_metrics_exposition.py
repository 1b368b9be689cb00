"""Prometheus metrics: names, values and units as a scraper sees them in the exposition text."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.kv_cache_manager.metrics import KVCacheMetrics
from services.model_runner.metrics import RunnerMetrics
from services.offload_store.metrics import OffloadMetrics
from services.scheduler.metrics import SchedulerMetrics
from shared.metrics import (
    new_registry,
    start_metrics_server,
    token_buckets,
)

MODEL = "SmolLM2-135M-Instruct"


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return _samples(registry)[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_every_metric_is_defined_once_across_all_services() -> None:
    # Registering all four groups into one registry raises on any duplicated name.
    registry = new_registry(process_collectors=False)
    for group in (SchedulerMetrics, KVCacheMetrics, RunnerMetrics, OffloadMetrics):
        group(registry, MODEL)
    names = {name for name, _ in _samples(registry)}
    assert names and all(n.startswith("kvmesh:") for n in names)


def test_kv_cache_usage_and_prefix_hits_appear_with_their_values() -> None:
    registry = new_registry(process_collectors=False)
    kv = KVCacheMetrics(registry, MODEL)
    kv.set_usage(used_blocks=256, usable_blocks=1024)
    kv.record_prefix_lookup(queried_tokens=100, hit_tokens=64)
    kv.record_prefix_lookup(queried_tokens=50, hit_tokens=0)
    assert _value(registry, "kvmesh:kv_cache_usage_perc") == 0.25
    assert _value(registry, "kvmesh:prefix_cache_queries_total") == 150
    assert _value(registry, "kvmesh:prefix_cache_hits_total") == 64
    with pytest.raises(ValueError):
        kv.record_prefix_lookup(queried_tokens=1, hit_tokens=2)


def test_finished_request_fills_latency_histograms_and_derives_tpot() -> None:
    registry = new_registry(process_collectors=False)
    sched = SchedulerMetrics(registry, MODEL, max_model_len=2048)
    sched.set_queues(running=3, waiting=2)
    sched.num_preemptions.inc()
    sched.add_step_tokens(prompt_tokens=128, generation_tokens=0)
    sched.add_step_tokens(prompt_tokens=0, generation_tokens=3)
    sched.observe_inter_token([0.1, 0.3])
    sched.observe_finished(finished_reason="length", e2e_s=1.0, queue_s=0.05, ttft_s=0.4,
                           prompt_tokens=128, generation_tokens=4)
    assert _value(registry, "kvmesh:num_requests_running") == 3
    assert _value(registry, "kvmesh:num_requests_waiting") == 2
    assert _value(registry, "kvmesh:num_preemptions_total") == 1
    assert _value(registry, "kvmesh:prompt_tokens_total") == 128
    assert _value(registry, "kvmesh:generation_tokens_total") == 3
    assert _value(registry, "kvmesh:request_success_total", finished_reason="length") == 1
    assert _value(registry, "kvmesh:time_to_first_token_seconds_sum") == pytest.approx(0.4)
    # TPOT = (e2e - ttft) / (tokens - 1) = 0.6 / 3
    assert _value(registry, "kvmesh:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert _value(registry, "kvmesh:inter_token_latency_seconds_count") == 2
    assert _value(registry, "kvmesh:inter_token_latency_seconds_bucket", le="0.1") == 1
    assert _value(registry, "kvmesh:e2e_request_latency_seconds_count") == 1
    assert _value(registry, "kvmesh:request_queue_time_seconds_sum") == pytest.approx(0.05)
    assert _value(registry, "kvmesh:request_prompt_tokens_bucket", le="200.0") == 1
    assert _value(registry, "kvmesh:request_generation_tokens_sum") == 4
    with pytest.raises(ValueError):
        sched.observe_finished(finished_reason="bored", e2e_s=1, queue_s=None, ttft_s=None,
                               prompt_tokens=1, generation_tokens=0)


def test_failed_request_does_not_count_as_a_first_token() -> None:
    registry = new_registry(process_collectors=False)
    sched = SchedulerMetrics(registry, MODEL)
    sched.observe_finished(finished_reason="error", e2e_s=0.2, queue_s=None, ttft_s=None,
                           prompt_tokens=5, generation_tokens=0)
    assert _value(registry, "kvmesh:time_to_first_token_seconds_count") == 0
    assert _value(registry, "kvmesh:request_queue_time_seconds_count") == 0
    assert _value(registry, "kvmesh:request_success_total", finished_reason="error") == 1


def test_offload_counters_by_tier() -> None:
    registry = new_registry(process_collectors=False)
    off = OffloadMetrics(registry, MODEL)
    assert _value(registry, "kvmesh:offload_hits_total", tier="disk") == 0  # present before any event
    off.hit("dram", 3)
    off.hit("disk")
    off.save("disk", 2)
    off.miss(4)
    off.corruption("disk")
    off.set_stored_bytes("dram", 1 << 20)
    assert _value(registry, "kvmesh:offload_hits_total", tier="dram") == 3
    assert _value(registry, "kvmesh:offload_hits_total", tier="disk") == 1
    assert _value(registry, "kvmesh:offload_saves_total", tier="disk") == 2
    assert _value(registry, "kvmesh:offload_misses_total") == 4
    assert _value(registry, "kvmesh:offload_corruptions_total", tier="disk") == 1
    assert _value(registry, "kvmesh:offload_stored_bytes", tier="dram") == 1 << 20
    with pytest.raises(ValueError):
        off.hit("s3")


def test_runner_step_metrics() -> None:
    registry = new_registry(process_collectors=False)
    runner = RunnerMetrics(registry, MODEL)
    runner.observe_step(0.08, num_tokens=33)
    assert _value(registry, "kvmesh:model_forward_time_seconds_sum") == pytest.approx(0.08)
    assert _value(registry, "kvmesh:iteration_tokens_total_bucket", le="50.0") == 1


def test_token_buckets_are_1_2_5() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_port_zero_disables_the_endpoint() -> None:
    assert start_metrics_server(0, new_registry(process_collectors=False)) is None
    with pytest.raises(ValueError):
        start_metrics_server(70000, new_registry(process_collectors=False))


def test_http_endpoint_serves_the_registry() -> None:
    registry = new_registry()
    KVCacheMetrics(registry, MODEL).set_usage(1, 4)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_metrics_server(port, registry, addr="127.0.0.1")
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert f'kvmesh:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.25' in body
    assert "process_cpu_seconds_total" in body  # the standard collectors are there
