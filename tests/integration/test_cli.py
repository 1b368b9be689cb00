"""The command line end to end: ``kvmesh demo`` (what ``make run`` runs) on a tiny model, and the
prefix-hash seed having one owner: the scheduler's deployment key is the one every tier hashes with."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc

from services.scheduler.client import KVMeshClient
from shared.auth import DEFAULT_TENANT, tenant_cache_salt
from shared.hashing import hash_blocks, hash_seed
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2, kv_cache_manager_pb2_grpc, model_runner_pb2, model_runner_pb2_grpc


def test_demo_starts_the_suite_streams_an_answer_and_stops(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "services.cli", "demo", "--model", str(tiny_llama_dir), "--port", "0",
           "--http-port", "0", "--exit-after-demo", "--max-tokens", "5", "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    order = ("kv-cache-manager", "model-runner", "offload-store", "scheduler", "gateway")
    for service in order:
        assert re.search(rf"^  {service}\s+127\.0\.0\.1:\d+", out, re.M), out
    # Progress while it starts (the runner alone may take a minute): each service, in start order.
    progress = re.findall(r"^kvmesh: (starting (\S+) \.\.\.|(\S+) up on 127\.0\.0\.1:\d+ in \d+\.\ds)$", out, re.M)
    assert [p[1] or p[2] for p in progress] == [name for name in order for _ in range(2)], out
    assert "user> What is the capital of France?" in out
    assert re.search(r"\[\d+ tokens, prompt \d+ \(0 cached\), TTFT \d+ ms", out), out
    assert "kvmesh: stopping" in out


def test_the_scheduler_is_the_one_owner_of_the_hash_seed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Issue 11/12: the key had two readers (and a start-up check that they agree); now the manager
    reads none and never hashes: its blocks carry the hashes the scheduler computes with its key."""
    common = {"KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_RUNNER_WARMUP": "0"}
    with ServiceProcess("kv-cache-manager", env={**common, "KVMESH_DEPLOYMENT_KEY": "key-a"}) as kvm, \
            ServiceProcess("model-runner", env=common) as runner, \
            grpc.insecure_channel(kvm.address) as kvm_channel, grpc.insecure_channel(runner.address) as rch:
        env = {**common, "KVMESH_DEPLOYMENT_KEY": "key-b", "KVMESH_SCHED_KVM_ADDRESS": kvm.address,
               "KVMESH_SCHED_RUNNER_ADDRESS": runner.address}
        info = model_runner_pb2_grpc.ModelRunnerStub(rch).GetModelInfo(model_runner_pb2.GetModelInfoRequest())
        with ServiceProcess("scheduler", env=env, startup_timeout=60, log_dir=str(tmp_path)) as sched:
            events = kv_cache_manager_pb2_grpc.KVCacheManagerStub(kvm_channel).SubscribeEvents(
                kv_cache_manager_pb2.SubscribeEventsRequest(), timeout=60)
            events.initial_metadata()
            prompt = list(range(3, 3 + 2 * info.block_size + 1))
            with KVMeshClient(sched.address) as client:
                client.complete(prompt, 1)
            stored = next(iter(events)).events[0].stored
            events.cancel()
    salt = tenant_cache_salt("key-b", DEFAULT_TENANT)  # auth is off on loopback: the default tenant
    assert list(stored.block_hashes) == hash_blocks(hash_seed(b"key-b", info.model_id), prompt, info.block_size, salt)
