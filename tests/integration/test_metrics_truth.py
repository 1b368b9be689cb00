"""Metrics that tell the truth: ``KVMESH_METRICS_PORT=N kvmesh up`` (the real command), real load
over gRPC, then every service's real ``/metrics`` scraped and checked for values, not only names.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.client import KVMeshClient
from tests.integration.ports import free_port_range

SERVICES = ("scheduler", "kv-cache-manager", "model-runner", "offload-store")  # metrics port = base + index
N_REQUESTS, MAX_TOKENS = 3, 12


class _Up:
    """``kvmesh up`` as a user runs it, with its addresses parsed from what it prints."""

    def __init__(self, model: Path, log_dir: Path, base: int) -> None:
        env = {**os.environ, "KVMESH_METRICS_PORT": str(base), "KVMESH_RUNNER_WARMUP": "0",
               "KVMESH_RUNNER_BLOCK_SIZE": "4", "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(64 * 2048)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", "0", "--http-port", "-1",
             "--log-dir", str(log_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL)
        self.out: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.out.append(line)
                m = re.match(r"kvmesh: serving on (\S+);", line)
                if m:
                    self.address = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(240)
        assert self.address, "".join(self.out)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    (value,) = [v for n, _labels, v in samples if n == name]
    return value


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[int, dict[str, list[tuple[str, dict[str, str], float]]]]]:
    base = free_port_range(len(SERVICES))
    up = _Up(tiny_llama_dir, tmp_path_factory.mktemp("metrics-up"), base)
    try:
        prompts = [[5 + i, 17, 33, 48, 90, 120, 7, 64, 200, 31, 11] for i in range(N_REQUESTS)]
        results: list[int] = []

        def one(p: list[int]) -> None:
            with KVMeshClient(up.address) as client:
                _, ids, _ = client.complete(p, MAX_TOKENS, ignore_eos=True)
                results.append(len(ids))

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == [MAX_TOKENS] * N_REQUESTS
        time.sleep(0.5)  # idle: the engine has freed the blocks and published its queues
        yield base, {name: _scrape(base + i) for i, name in enumerate(SERVICES)}
    finally:
        up.stop()


def test_every_service_serves_metrics_on_its_own_port(loaded: tuple[int, dict[str, list]]) -> None:
    _, scraped = loaded
    assert set(scraped) == set(SERVICES)
    assert all(any(n.startswith("kvmesh:") for n, _, _ in samples) for samples in scraped.values())


def test_inter_token_latency_records_every_gap(loaded: tuple[int, dict[str, list]]) -> None:
    _, scraped = loaded
    assert _value(scraped["scheduler"], "kvmesh:inter_token_latency_seconds_count") == N_REQUESTS * (MAX_TOKENS - 1)


def test_queues_are_empty_when_idle(loaded: tuple[int, dict[str, list]]) -> None:
    _, scraped = loaded
    assert _value(scraped["scheduler"], "kvmesh:num_requests_running") == 0
    assert _value(scraped["scheduler"], "kvmesh:num_requests_waiting") == 0
    assert _value(scraped["scheduler"], "kvmesh:generation_tokens_total") == N_REQUESTS * MAX_TOKENS


def test_kv_cache_usage_follows_free(loaded: tuple[int, dict[str, list]]) -> None:
    _, scraped = loaded
    assert _value(scraped["kv-cache-manager"], "kvmesh:kv_cache_usage_perc") == 0.0


def test_one_model_name_on_every_service(loaded: tuple[int, dict[str, list]], tiny_llama_dir: Path) -> None:
    _, scraped = loaded
    names = {labels["model_name"] for samples in scraped.values() for n, labels, _ in samples if "model_name" in labels}
    assert names == {tiny_llama_dir.name}


def test_metrics_bind_to_the_services_host(loaded: tuple[int, dict[str, list]]) -> None:
    base, _ = loaded
    listening = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, port = local.split(":")
        if state == "0A":  # LISTEN
            listening[int(port, 16)] = addr
    for i in range(len(SERVICES)):
        assert listening[base + i] == "0100007F", (base + i, listening.get(base + i))  # 127.0.0.1


def test_names_follow_vllm(loaded: tuple[int, dict[str, list]]) -> None:
    _, scraped = loaded
    sched, runner, kvm = scraped["scheduler"], scraped["model-runner"], scraped["kv-cache-manager"]
    names = {n for samples in scraped.values() for n, _, _ in samples}
    assert {"kvmesh:num_preemptions_total", "kvmesh:prefix_cache_queries_total", "kvmesh:prefix_cache_hits_total",
            "kvmesh:iteration_tokens_total_count"} <= names
    # prefill = first scheduled -> first token; decode = first token -> last token (one each per request)
    assert _value(sched, "kvmesh:request_prefill_time_seconds_count") == N_REQUESTS
    assert _value(sched, "kvmesh:request_decode_time_seconds_count") == N_REQUESTS
    e2e = _value(sched, "kvmesh:e2e_request_latency_seconds_sum")
    parts = sum(_value(sched, f"kvmesh:{n}_sum") for n in ("request_queue_time_seconds", "request_prefill_time_seconds",
                                                           "request_decode_time_seconds"))
    assert parts == pytest.approx(e2e, rel=1e-6)
    # every token the runner computed is one the scheduler counted (prompt + generated)
    assert _value(runner, "kvmesh:iteration_tokens_total_sum") == (
        _value(sched, "kvmesh:prompt_tokens_total") + _value(sched, "kvmesh:generation_tokens_total") - N_REQUESTS)
    assert _value(kvm, "kvmesh:prefix_cache_queries_total") >= _value(kvm, "kvmesh:prefix_cache_hits_total")
    # every step the runner ran is one the scheduler collected, planned synchronously or sent ahead
    # (block size 4: decodes at a block's 2nd-4th slot need no allocation, so some were sent ahead)
    steps = {labels["planned"]: v for n, labels, v in sched if n == "kvmesh:steps_total"}
    assert set(steps) == {"synchronous", "ahead"} and steps["ahead"] > 0
    assert steps["synchronous"] + steps["ahead"] == _value(runner, "kvmesh:iteration_tokens_total_count")


def test_dashboard_queries_name_real_series(loaded: tuple[int, dict[str, list]]) -> None:
    import json

    _, scraped = loaded
    dashboard = json.loads((Path(__file__).parents[2] / "k8s/local/grafana/dashboards/kvmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"kvmesh:[a-z0-9_]+", e)}
    names = {n for samples in scraped.values() for n, _, _ in samples}
    assert used and used <= names, sorted(used - names)
