"""The shared remote tier across real processes: two suites (two replicas, each its own four
services, pool, DRAM, disk and index) whose offload-stores share the real Redis at 127.0.0.1:6379
through ``KVMESH_OFFLOAD_REMOTE_URL``. Replica B answers a prompt that replica A computed from the
remote tier; the offload-store's ``/metrics`` reports it."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc
from tests.integration.ports import free_port_range

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # two suites: eight processes
OFFLOAD_METRICS_OFFSET = 3  # services/suite.py METRICS_PORT_OFFSETS


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


@pytest.fixture
def replicas(tiny_llama_dir: Path, tmp_path: Path, redis_url: str, remote_prefix: str
             ) -> Iterator[tuple[Suite, Suite, int]]:
    env = {
        "KVMESH_RUNNER_BLOCK_SIZE": "4",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(30 * 2048),  # 29 usable blocks
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_RUNNER_DTYPE": "float32",  # warm == cold is shown for fp32
        "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20),
        "KVMESH_OFFLOAD_REMOTE_URL": redis_url,
        "KVMESH_OFFLOAD_REMOTE_KEY_PREFIX": remote_prefix,
    }
    metrics_b = free_port_range()
    a = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, log_dir=str(tmp_path / "a"),
                          extra_env=env))
    try:
        b = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, log_dir=str(tmp_path / "b"),
                              extra_env=env, metrics_port=metrics_b))
        try:
            yield a, b, metrics_b + OFFLOAD_METRICS_OFFSET
        finally:
            b.stop()
    finally:
        a.stop()


def test_replica_b_loads_replica_a_prefix_from_redis(replicas: tuple[Suite, Suite, int]) -> None:
    a, b, metrics_port = replicas
    prompt = _prompt(1, 41)
    with KVMeshClient(a.address) as client:
        _, cold, final = client.complete(prompt, 4, ignore_eos=True)
        assert final.cached_tokens == 0
        for seed in (101, 102):  # A's pool evicts the prompt: saved to A's store and to Redis
            client.complete(_prompt(seed, 100), 2, ignore_eos=True)
    with KVMeshClient(b.address) as client:
        _, warm, final = client.complete(prompt, 4, ignore_eos=True)
    assert warm == cold
    assert final.cached_tokens == 40
    store = offload_store_pb2_grpc.OffloadStoreStub(grpc.insecure_channel(b.services["offload-store"].address))
    stats = store.GetStats(offload_store_pb2.GetOffloadStatsRequest())
    assert (stats.dram_hits, stats.disk_hits, stats.misses) == (0, 0, 0)  # all 10 came from Redis
    assert _metric(metrics_port, "kvmesh:offload_remote_hits_total") == 10
    assert _metric(metrics_port, "kvmesh:offload_remote_errors_total") == 0
    assert _metric(metrics_port, "kvmesh:offload_remote_up") == 1
