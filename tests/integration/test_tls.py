"""Transport security over real processes: TLS on the public API, mutual TLS between services,
a plaintext health-only port for probes (docs/security.md). Certificates are made by the
fixtures in conftest.py (shared/devcerts.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.client import KVMeshClient
from shared.channels import open_channel
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import (
    kv_cache_manager_pb2,
    kv_cache_manager_pb2_grpc,
    offload_store_pb2,
    offload_store_pb2_grpc,
)
from shared.tls import TLSFiles

if TYPE_CHECKING:
    from conftest import Certs, SecureSuite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stats_code(address: str, tls: TLSFiles | None) -> grpc.StatusCode:
    channel = grpc.insecure_channel(address) if tls is None else open_channel(address, tls=tls)
    with channel:
        try:
            kv_cache_manager_pb2_grpc.KVCacheManagerStub(channel).GetStats(
                kv_cache_manager_pb2.GetStatsRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_internal_service_requires_a_client_certificate_from_the_service_ca(certs: Certs) -> None:
    health_port = _free_port()
    env = {**certs.env(certs.service), "KVMESH_HEALTH_PORT": str(health_port), "KVMESH_TLS_ALLOWED_PEERS": "scheduler"}
    with ServiceProcess("kv-cache-manager", env=env) as kvm:
        assert _stats_code(kvm.address, certs.client(certs.service)) == grpc.StatusCode.OK
        # The handshake refuses: plaintext, no client certificate, a certificate of another CA.
        assert _stats_code(kvm.address, None) == grpc.StatusCode.UNAVAILABLE
        assert _stats_code(kvm.address, certs.client(None)) == grpc.StatusCode.UNAVAILABLE
        assert _stats_code(kvm.address, certs.client(certs.rogue)) == grpc.StatusCode.UNAVAILABLE
        # A valid certificate of a service not allowed to call this one.
        assert _stats_code(kvm.address, certs.client(certs.intruder)) == grpc.StatusCode.PERMISSION_DENIED
        # Probes: the plaintext health port answers health checks and nothing else.
        health_address = f"127.0.0.1:{health_port}"
        with grpc.insecure_channel(health_address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert _stats_code(health_address, None) == grpc.StatusCode.UNAUTHENTICATED


MAX_TOKENS = 6


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 370, (24,), generator=g).tolist()
    return [system + torch.randint(3, 370, (3 + 4 * i,), generator=g).tolist() for i in range(3)]


def test_suite_over_mutual_tls_is_token_identical(secure_suite: SecureSuite, tiny_llama_dir: Path) -> None:
    """The secure suite (tests/integration/conftest.py): every service on mutual TLS."""
    from transformers import AutoModelForCausalLM

    tls_suite, certs = secure_suite.suite, secure_suite.certs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with secure_suite.client("sk-team-a-000000000001") as client:  # TLS, no client certificate
        for prompt in _prompts():
            _, ids, final = client.complete(prompt, MAX_TOKENS, ignore_eos=True)
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            assert ids == expected
        assert final.cached_tokens == 24  # the shared system prompt, through the mTLS kv-cache-manager
    with KVMeshClient(tls_suite.address, api_key="sk-team-a-000000000001") as plain, \
            pytest.raises(grpc.RpcError) as err:
        plain.model_info()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Every internal service of the suite refuses a peer without a certificate.
    for name in ("kv-cache-manager", "model-runner", "offload-store"):
        with open_channel(tls_suite.services[name].address, tls=certs.client(None)) as channel, \
                pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_offload_store_refuses_saves_from_anyone_but_the_scheduler(secure_suite: SecureSuite) -> None:
    """Issue 12 item 7: anyone reaching the store's port could overwrite another tenant's KV."""
    address = secure_suite.suite.services["offload-store"].address
    certs = secure_suite.certs
    with secure_suite.internal_channel("offload-store") as channel:  # the scheduler's certificate
        store = offload_store_pb2_grpc.OffloadStoreStub(channel)
        before = store.GetStats(offload_store_pb2.GetOffloadStatsRequest(), timeout=5)
        save = offload_store_pb2.SaveRequest(blocks=[offload_store_pb2.BlockRef(block_hash=b"\x01" * 32, block_id=1)])
        for tls, code in ((certs.client(None), grpc.StatusCode.UNAVAILABLE),
                          (certs.client(certs.rogue), grpc.StatusCode.UNAVAILABLE),
                          (certs.client(certs.intruder), grpc.StatusCode.PERMISSION_DENIED)):
            with open_channel(address, tls=tls) as other, pytest.raises(grpc.RpcError) as err:
                offload_store_pb2_grpc.OffloadStoreStub(other).Save(save, timeout=5)
            assert err.value.code() == code
        after = store.GetStats(offload_store_pb2.GetOffloadStatsRequest(), timeout=5)
    assert (after.saves, after.dram_blocks, after.disk_blocks) == (before.saves, before.dram_blocks, before.disk_blocks)
