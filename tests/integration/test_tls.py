"""Transport security over real processes: TLS on the public API, mutual TLS between services,
a plaintext health-only port for probes (docs/security.md). Certificates are made here
(shared/devcerts.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.suite import Suite, SuiteConfig
from shared.channels import open_channel
from shared.client import KVMeshClient
from shared.devcerts import make_ca, make_cert
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2, kv_cache_manager_pb2_grpc
from shared.tls import TLSFiles


@dataclass(frozen=True)
class Certs:
    ca: str
    service: TLSFiles  # CN "scheduler", signed by the service CA
    intruder: TLSFiles  # CN "intruder", signed by the service CA
    rogue: TLSFiles  # CN "scheduler", signed by another CA

    def env(self, files: TLSFiles) -> dict[str, str]:
        return {"KVMESH_TLS_CERT": files.cert, "KVMESH_TLS_KEY": files.key, "KVMESH_TLS_CA": self.ca}

    def client(self, files: TLSFiles | None) -> TLSFiles:
        return TLSFiles(cert=files.cert, key=files.key, ca=self.ca) if files else TLSFiles(ca=self.ca)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(folder, "kvmesh-service-ca"), make_ca(folder / "rogue", "another-ca")
    return Certs(ca=str(ca.path), service=make_cert(folder, "scheduler", ca),
                 intruder=make_cert(folder, "intruder", ca), rogue=make_cert(folder / "rogue", "scheduler", other))


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


@pytest.fixture(scope="module")
def tls_suite(tiny_llama_dir: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {
        **certs.env(certs.service),
        "KVMESH_RUNNER_BLOCK_SIZE": "4",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(64 * 2048),
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20),
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=True,
                          log_dir=str(tmp_path_factory.mktemp("suite-tls")), extra_env=env))
    yield s
    s.stop()


def test_suite_over_mutual_tls_is_token_identical(tls_suite: Suite, certs: Certs, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with KVMeshClient(tls_suite.address, tls=TLSFiles(ca=certs.ca)) as client:  # TLS, no client certificate
        for prompt in _prompts():
            _, ids, final = client.complete(prompt, MAX_TOKENS, ignore_eos=True)
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            assert ids == expected
        assert final.cached_tokens == 24  # the shared system prompt, through the mTLS kv-cache-manager
    with KVMeshClient(tls_suite.address) as plain, pytest.raises(grpc.RpcError) as err:
        plain.model_info()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Every internal service of the suite refuses a peer without a certificate.
    for name in ("kv-cache-manager", "model-runner", "offload-store"):
        with open_channel(tls_suite.services[name].address, tls=certs.client(None)) as channel, \
                pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
