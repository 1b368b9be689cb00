"""The secure suite shared by test_tenants.py and test_tls.py: the production configuration on
loopback — API keys (a keys file), mutual TLS between every service, TLS for clients, the
offload-store — started once for both modules (docs/security.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.channels import open_channel
from shared.devcerts import make_ca, make_cert
from shared.tls import TLSFiles

BLOCK = 4
DEPLOYMENT_KEY = "secure-suite-deployment-key"
# key -> tenant; team-b's line gives it the priority floor -10.
KEYS = {
    "sk-team-a-000000000001": "team-a",
    "sk-team-a-000000000002": "team-a",  # a second key of the same tenant
    "sk-team-b-000000000001": "team-b",
}
KEYS_TEXT = "# key  tenant  [min_priority]\n" + "".join(
    f"{k}  {t}{'  -10' if t == 'team-b' else ''}\n" for k, t in KEYS.items())


def write_keys(path: Path, text: str) -> None:
    """Replaces the keys file atomically (a new inode, as a Kubernetes Secret update does)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass(frozen=True)
class Certs:
    """The service CA and certificates (shared/devcerts.py), plus two that must be refused."""

    ca: str
    service: TLSFiles  # CN "scheduler", signed by the service CA (every service of the suite uses it)
    intruder: TLSFiles  # CN "intruder", signed by the service CA
    rogue: TLSFiles  # CN "scheduler", signed by another CA

    def env(self, files: TLSFiles) -> dict[str, str]:
        """The TLS variables a service started with ``files`` gets."""
        return {"KVMESH_TLS_CERT": files.cert, "KVMESH_TLS_KEY": files.key, "KVMESH_TLS_CA": self.ca}

    def client(self, files: TLSFiles | None) -> TLSFiles:
        """Client-side files: verify with the service CA, present ``files`` (or no certificate)."""
        return TLSFiles(cert=files.cert, key=files.key, ca=self.ca) if files else TLSFiles(ca=self.ca)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(folder, "kvmesh-service-ca"), make_ca(folder / "rogue", "another-ca")
    return Certs(ca=str(ca.path), service=make_cert(folder, "scheduler", ca),
                 intruder=make_cert(folder, "intruder", ca), rogue=make_cert(folder / "rogue", "scheduler", other))


@dataclass(frozen=True)
class SecureSuite:
    """The running suite and how to reach it."""

    suite: Suite
    certs: Certs
    keys_file: Path
    keys_text: str = KEYS_TEXT  # what the keys file holds at start
    deployment_key: str = DEPLOYMENT_KEY
    block_size: int = BLOCK

    def write_keys(self, text: str) -> None:
        """Replaces the keys file atomically (a new inode, as a Kubernetes Secret update does)."""
        write_keys(self.keys_file, text)

    @property
    def address(self) -> str:
        """The public API."""
        return self.suite.address

    def client(self, api_key: str | None) -> KVMeshClient:
        """A public-API client over TLS (no client certificate: the key authenticates)."""
        return KVMeshClient(self.address, api_key=api_key, tls=TLSFiles(ca=self.certs.ca))

    def internal_channel(self, service: str) -> grpc.Channel:
        """A channel to an internal service with the scheduler's certificate (what it allows)."""
        return open_channel(self.suite.services[service].address, tls=self.certs.client(self.certs.service))


@pytest.fixture(scope="session")
def secure_suite(tiny_llama_dir: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[SecureSuite]:
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    write_keys(keys_file, KEYS_TEXT)
    env = {
        **certs.env(certs.service),
        "KVMESH_TLS_ALLOWED_PEERS": "scheduler",
        "KVMESH_AUTH_KEYS_FILE": str(keys_file),
        "KVMESH_AUTH_RELOAD_SECONDS": "0.1",
        "KVMESH_DEPLOYMENT_KEY": DEPLOYMENT_KEY,
        "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(30 * 2048),  # 29 usable blocks (of fp32: 2048 bytes each)
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20),
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=True,
                          log_dir=str(tmp_path_factory.mktemp("suite-secure")), extra_env=env))
    yield SecureSuite(s, certs, keys_file)
    s.stop()
