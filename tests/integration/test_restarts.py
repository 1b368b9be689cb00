"""Process restarts never change an answer (issue 12, items 1-4 and 7): the whole suite as real
processes on loopback, each service SIGKILLed and started again on its port.

Pool: 48 blocks of 4 tokens (2,048 bytes each for the tiny model), so a few 60-token fillers evict
an older prompt's blocks into the offload-store's DRAM tier. The cold reference of a prompt is its
first answer on the fresh suite (0 cached tokens); greedy decoding makes any later answer of the
same prompt equal to it unless cached KV is wrong.

The tests share one suite and run in file order (each leaves it serving).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.hashing import hash_blocks, hash_seed
from shared.owner_channel import with_owner
from shared.pb.kvmesh.v1 import (
    kv_cache_manager_pb2,
    kv_cache_manager_pb2_grpc,
    model_runner_pb2,
    model_runner_pb2_grpc,
    offload_store_pb2,
    offload_store_pb2_grpc,
)

MAX_TOKENS = 8
BLOCK = 4
NUM_BLOCKS = 48  # including the null block
TIMEOUT = 10.0


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P1 = _tokens(1, 40)  # cached in the pool when the runner dies
P2 = _tokens(2, 40)  # evicted into the offload-store's DRAM tier before the runner dies
FILLERS = [_tokens(10 + i, 60) for i in range(3)]


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {
        "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(NUM_BLOCKS * 2048),
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_OFFLOAD_DRAM_BYTES": str(256 * 2048),
        "KVMESH_SCHED_OWNER_LEASE_SECONDS": "2",  # a SIGKILLed scheduler's successor waits <= 2 s
        "KVMESH_SCHED_RPC_TIMEOUT_SECONDS": "10",
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=True,
                          log_dir=str(tmp_path_factory.mktemp("restart-logs")), extra_env=env))
    yield s
    s.stop()


def _complete(suite: Suite, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """(token ids, cached tokens) of one greedy request."""
    with KVMeshClient(suite.address) as client:
        _, ids, final = client.complete(prompt, max_tokens, ignore_eos=True)
    return ids, final.cached_tokens


def _kvm(suite: Suite) -> kv_cache_manager_pb2_grpc.KVCacheManagerStub:
    return kv_cache_manager_pb2_grpc.KVCacheManagerStub(
        grpc.insecure_channel(suite.services["kv-cache-manager"].address))


def _store(suite: Suite, owner: str = "") -> offload_store_pb2_grpc.OffloadStoreStub:
    channel = grpc.insecure_channel(suite.services["offload-store"].address)
    return offload_store_pb2_grpc.OffloadStoreStub(with_owner(channel, owner) if owner else channel)


def _store_stats(suite: Suite) -> offload_store_pb2.OffloadStats:
    return _store(suite).GetStats(offload_store_pb2.GetOffloadStatsRequest(), timeout=TIMEOUT)


def _runner(suite: Suite) -> model_runner_pb2_grpc.ModelRunnerStub:
    return model_runner_pb2_grpc.ModelRunnerStub(grpc.insecure_channel(suite.services["model-runner"].address))


def _wait_idle_and_free(suite: Suite, timeout: float = 15.0) -> kv_cache_manager_pb2.KVCacheStats:
    """The kv-cache-manager's stats once every block is free again (integrity checked)."""
    kvm = _kvm(suite)
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = kvm.GetStats(kv_cache_manager_pb2.GetStatsRequest(), timeout=TIMEOUT)
            if stats.num_blocks and stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks:
                assert kvm.CheckIntegrity(kv_cache_manager_pb2.CheckIntegrityRequest(), timeout=TIMEOUT).ok
                return stats
        except grpc.RpcError as exc:  # a restarted manager not yet bound (CheckIntegrity)
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("the kv-cache-manager never returned to all blocks free")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cold(suite: Suite) -> dict[str, list[int]]:
    """Cold answers, leaving P1 in the pool and P2 only in the offload-store (DRAM)."""
    ref2, cached2 = _complete(suite, P2)
    for filler in FILLERS:
        _complete(suite, filler)
    ref1, cached1 = _complete(suite, P1)
    assert (cached1, cached2) == (0, 0)
    assert _store_stats(suite).saves >= len(P2) // BLOCK  # P2's full blocks were evicted and saved
    return {"P1": ref1, "P2": ref2}


def test_runner_restart_serves_cold_run_answers(suite: Suite, cold: dict[str, list[int]]) -> None:
    """Item 1: after a runner SIGKILL + restart, the pool's and the store's cached prefixes of the
    dead pool must not be served as if they were in the new pool."""
    assert _complete(suite, P1) == (cold["P1"], 36)  # before the kill: a pool hit, same answer
    old_handle = _runner(suite).GetKVPoolHandle(model_runner_pb2.GetKVPoolHandleRequest(), timeout=TIMEOUT)
    assert os.path.exists(old_handle.path)
    dram_hits = _store_stats(suite).dram_hits
    suite.restart("model-runner")  # SIGKILL: the pool file is left behind ...
    assert not os.path.exists(old_handle.path)  # ... and removed by the new runner
    info = _runner(suite).GetModelInfo(model_runner_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.pool_id and info.pool_id != old_handle.generation
    # P1 was cached only in the dead pool: recomputed, 0 cached tokens, the cold answer.
    assert _complete(suite, P1) == (cold["P1"], 0)
    # P2 lives in the store's DRAM: reloaded into the *new* pool (36 tokens, 9 blocks), same answer.
    assert _complete(suite, P2) == (cold["P2"], 36)
    stats = _store_stats(suite)
    assert stats.dram_hits - dram_hits == 9
    assert (stats.pool_attached, stats.pool_generation) == (True, info.pool_id)
    kvm = _wait_idle_and_free(suite)
    assert (kvm.pool_id, kvm.num_blocks) == (info.pool_id, info.num_blocks - 1)


def test_offload_store_refuses_non_owners(suite: Suite, cold: dict[str, list[int]]) -> None:
    """Item 7: anyone reaching the store's port could overwrite (Save) or read (Load) cached KV."""
    handle = _runner(suite).GetKVPoolHandle(model_runner_pb2.GetKVPoolHandleRequest(), timeout=TIMEOUT)
    seed = hash_seed(b"kvmesh-dev", _runner(suite).GetModelInfo(model_runner_pb2.GetModelInfoRequest()).model_id)
    victim = hash_blocks(seed, P2, BLOCK)[0]
    before = _store_stats(suite)
    for owner in ("", "stranger"):
        stranger = _store(suite, owner)
        calls = {
            "Save": lambda s: s.Save(offload_store_pb2.SaveRequest(
                blocks=[offload_store_pb2.BlockRef(block_hash=victim, block_id=1)]), timeout=TIMEOUT),
            "Load": lambda s: s.Load(offload_store_pb2.LoadRequest(
                blocks=[offload_store_pb2.BlockRef(block_hash=victim, block_id=1)]), timeout=TIMEOUT),
            "Release": lambda s: s.Release(offload_store_pb2.ReleaseOffloadRequest(), timeout=TIMEOUT),
        }
        if owner:  # an anonymous AttachPool is INVALID_ARGUMENT (no owner id), a stranger's is fenced
            calls["AttachPool"] = lambda s: s.AttachPool(offload_store_pb2.AttachPoolRequest(pool=handle),
                                                         timeout=TIMEOUT)
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call(stranger)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (owner, name, info.value.details())
    after = _store_stats(suite)
    assert (after.saves, after.dram_hits, after.misses) == (before.saves, before.dram_hits, before.misses)
    assert _complete(suite, P2) == (cold["P2"], 36)  # the victim's answer is unchanged


def test_offload_store_restart_is_reattached(suite: Suite, cold: dict[str, list[int]]) -> None:
    """Item 4: a restarted store was never re-attached (0 saves after many evictions, silently)."""
    suite.restart("offload-store")
    assert _store_stats(suite).saves == 0
    # The scheduler's keep-alive (a third of its 2 s lease) finds the store has no owner and attaches.
    deadline = time.monotonic() + 10
    while not _store_stats(suite).pool_attached:
        assert time.monotonic() < deadline, suite.services["scheduler"].log_tail()
        time.sleep(0.05)
    for filler in FILLERS:  # evicts P1, P2 and earlier fillers from the pool
        _complete(suite, filler)
    stats = _store_stats(suite)
    assert stats.saves > 0 and stats.refused_no_pool == 0
    assert _complete(suite, P1)[0] == cold["P1"]
    _wait_idle_and_free(suite)


def test_kv_cache_manager_restart_is_reinitialized_by_the_scheduler(suite: Suite,
                                                                      cold: dict[str, list[int]]) -> None:
    """Item 3: a restarted manager came up with its own defaults (1,023 blocks, another seed)."""
    suite.restart("kv-cache-manager")
    # A bare manager serves no pool of its own (unbound), and once the scheduler's keep-alive has
    # re-initialized it, nobody but that scheduler may allocate.
    with pytest.raises(grpc.RpcError) as info:
        _kvm(suite).AllocateSlots(kv_cache_manager_pb2.AllocateSlotsRequest(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details() or ""
    assert details.startswith(("not initialized", "not the owner")), details
    big = _tokens(99, 140)  # with its 40 output tokens 45 of the runner's 47 blocks
    ref_big = _complete(suite, big, 40)[0]
    assert len(ref_big) == 40
    assert _complete(suite, P2)[0] == cold["P2"]
    assert _complete(suite, P1)[0] == cold["P1"]
    runner = _runner(suite).GetModelInfo(model_runner_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    stats = _wait_idle_and_free(suite)
    assert (stats.num_blocks, stats.block_size, stats.pool_id) == (runner.num_blocks - 1, BLOCK, runner.pool_id)


def test_scheduler_killed_with_requests_in_flight_is_replaced(suite: Suite, cold: dict[str, list[int]]) -> None:
    """Item 2: after a SIGKILL with live requests the next scheduler exited 1 ("N requests are live")."""
    started = threading.Barrier(4)
    errors: list[grpc.StatusCode] = []

    def stream(prompt: list[int]) -> None:
        with KVMeshClient(suite.address) as client:
            try:
                for i, _ in enumerate(client.generate(prompt, 48, ignore_eos=True)):  # 15 blocks each
                    if i == 0:
                        started.wait(30)
            except grpc.RpcError as exc:
                errors.append(exc.code())

    threads = [threading.Thread(target=stream, args=(_tokens(50 + i, 12),)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(30)
    assert _kvm(suite).GetStats(kv_cache_manager_pb2.GetStatsRequest(), timeout=TIMEOUT).num_requests == 3
    suite.restart("scheduler")  # SIGKILL mid-stream; the successor waits out the 2 s lease
    for t in threads:
        t.join(30)
    assert errors == [grpc.StatusCode.UNAVAILABLE] * 3
    stats = _wait_idle_and_free(suite)  # the successor freed the dead scheduler's requests
    assert stats.num_requests == 0
    assert _complete(suite, P1)[0] == cold["P1"]
    assert _complete(suite, P2)[0] == cold["P2"]
