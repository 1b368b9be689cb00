"""The offload flow across real processes: the scheduler saves evicted blocks to the offload-store
and loads them back through the runner's shared-memory pool; only hashes and ids cross gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {
        "KVMESH_RUNNER_BLOCK_SIZE": "4",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(30 * 2048),  # 29 usable blocks
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_RUNNER_DTYPE": "float32",  # warm == cold is shown for fp32 (bf16 is AMX machines' default)
        "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20),
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=True,
                          log_dir=str(tmp_path_factory.mktemp("suite-offload")), extra_env=env))
    yield s
    s.stop()


def test_evicted_prefix_comes_back_from_the_store(suite: Suite) -> None:
    prompt = _prompt(1, 41)
    with KVMeshClient(suite.address) as client:
        _, cold, cold_final = client.complete(prompt, 4, ignore_eos=True)
        assert cold_final.cached_tokens == 0
        for seed in (101, 102):  # push the prompt's blocks out of the pool
            client.complete(_prompt(seed, 100), 2, ignore_eos=True)
        _, warm, warm_final = client.complete(prompt, 4, ignore_eos=True)
    assert warm == cold
    assert warm_final.cached_tokens == 40
    store = offload_store_pb2_grpc.OffloadStoreStub(grpc.insecure_channel(suite.services["offload-store"].address))
    stats = store.GetStats(offload_store_pb2.GetOffloadStatsRequest())
    assert stats.dram_hits == 10 and stats.saves >= 10


def test_store_down_means_recompute_not_failure(suite: Suite) -> None:
    """Runs last in this module: with the offload-store stopped, requests are still answered the same."""
    prompt = _prompt(7, 41)
    with KVMeshClient(suite.address) as client:
        _, before, _ = client.complete(prompt, 4, ignore_eos=True, cache_salt="down-test")
        suite.services["offload-store"].stop()
        for seed in (103, 104):
            client.complete(_prompt(seed, 100), 2, ignore_eos=True)  # evictions: saves now fail
        _, after, final = client.complete(prompt, 4, ignore_eos=True, cache_salt="down-test")
    assert after == before
    assert final.cached_tokens == 0  # nothing could be loaded: recomputed
