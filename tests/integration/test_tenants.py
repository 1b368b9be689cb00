"""Tenants over the real suite (processes, gRPC, offload-store): API keys, per-tenant cache salts,
the priority floor and hot reload of the keys file (docs/security.md)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.client import KVMeshClient
from shared.auth import tenant_cache_salt
from shared.channels import open_channel
from shared.hashing import hash_blocks, hash_seed
from shared.pb.kvmesh.v1 import offload_store_pb2, offload_store_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from shared.tls import TLSFiles

if TYPE_CHECKING:
    from conftest import SecureSuite

KEY_A, KEY_A2, KEY_B = "sk-team-a-000000000001", "sk-team-a-000000000002", "sk-team-b-000000000001"
KEY_C = "sk-team-c-000000000001"  # added by the hot-reload test


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(11, 41)  # 10 full blocks of 4; at most 40 tokens can come from a cache


def _complete(suite: SecureSuite, key: str, prompt: list[int], **kwargs: object) -> tuple[list[int], int]:
    with suite.client(key) as client:
        _, ids, final = client.complete(prompt, 4, ignore_eos=True, **kwargs)
    return ids, final.cached_tokens


def _code(fn: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()  # type: ignore[operator]
    return err.value.code()


def test_tenants_do_not_share_prefixes_and_offload_keys_differ(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    cold_a, cached_a = _complete(suite, KEY_A, PROMPT)
    cold_b, cached_b = _complete(suite, KEY_B, PROMPT)
    warm_a, cached_a2 = _complete(suite, KEY_A, PROMPT)
    assert (cached_a, cached_b, cached_a2) == (0, 0, 40)  # B never reads A's blocks; A's second hits
    assert cold_b == cold_a and warm_a == cold_a
    # Push both tenants' blocks out of the pool: they are saved under each tenant's own keys.
    for seed in (101, 102):
        _complete(suite, KEY_A2, _prompt(seed, 100), cache_salt=f"filler-{seed}")
    with suite.client(KEY_A) as client:
        model_id = client.model_info().model_id
    seed = hash_seed(suite.deployment_key.encode(), model_id)
    chains = {
        "team-a": hash_blocks(seed, PROMPT, suite.block_size, tenant_cache_salt(suite.deployment_key, "team-a")),
        "team-b": hash_blocks(seed, PROMPT, suite.block_size, tenant_cache_salt(suite.deployment_key, "team-b")),
        "client salt only": hash_blocks(seed, PROMPT, suite.block_size),
    }
    assert not set(chains["team-a"]) & set(chains["team-b"])
    store = offload_store_pb2_grpc.OffloadStoreStub(suite.internal_channel("offload-store"))
    found = store.Lookup(offload_store_pb2.LookupRequest(
        chains=[offload_store_pb2.HashChain(block_hashes=c) for c in chains.values()])).num_present
    assert list(found) == [10, 10, 0]
    reload_b, cached_b2 = _complete(suite, KEY_B, PROMPT)  # B's own blocks come back from the store
    assert reload_b == cold_a and cached_b2 == 40


def test_sharing_within_a_tenant_is_unchanged(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    prompt = _prompt(12, 41)
    first, cached = _complete(suite, KEY_A, prompt)
    again, cached_other_key = _complete(suite, KEY_A2, prompt)  # another key of team-a: shared
    salted, cached_salted = _complete(suite, KEY_A, prompt, cache_salt="narrow")  # a client salt narrows
    salted2, cached_salted2 = _complete(suite, KEY_A2, prompt, cache_salt="narrow")
    assert (cached, cached_other_key, cached_salted, cached_salted2) == (0, 40, 0, 40)
    assert first == again == salted == salted2


def test_missing_or_invalid_key_is_unauthenticated(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    channel = open_channel(suite.address, tls=TLSFiles(ca=suite.certs.ca))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    req = KVMeshClient.request(PROMPT, 2)
    bad = (("authorization", "Bearer sk-not-a-key-0000000000"),)
    not_bearer = (("authorization", KEY_A),)
    assert _code(lambda: list(stub.Generate(req))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: list(stub.Generate(req, metadata=bad))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: list(stub.Generate(req, metadata=not_bearer))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: stub.Tokenize(scheduler_pb2.TokenizeRequest(text="hi"))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), metadata=bad)
                 ) == grpc.StatusCode.UNAUTHENTICATED
    # Probes carry no key and still work.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_priority_floor_per_tenant(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    with suite.client(KEY_A) as a, suite.client(KEY_B) as b:
        with pytest.raises(grpc.RpcError) as err:
            a.complete(PROMPT, 2, priority=-1000)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "priority: -1000 is below this tenant's minimum 0 (lower runs first)"
        assert a.complete(PROMPT, 2, priority=0)[2].completion_tokens == 2
        assert b.complete(PROMPT, 2, priority=-10)[2].completion_tokens == 2  # team-b's floor is -10
        with pytest.raises(grpc.RpcError) as err:
            b.complete(PROMPT, 2, priority=-11)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_keys_file_hot_reload(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    def status(key: str) -> grpc.StatusCode:
        with suite.client(key) as client:
            try:
                client.model_info()
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert (status(KEY_B), status(KEY_C)) == (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)
    try:
        suite.write_keys(suite.keys_text.replace(KEY_B, KEY_C).replace("team-b  -10", "team-c"))
        deadline = time.monotonic() + 10
        while status(KEY_C) != grpc.StatusCode.OK and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (status(KEY_B), status(KEY_C)) == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)
        suite.write_keys("this line is not a key file\n")  # a broken update keeps the last good keys
        time.sleep(0.5)
        assert (status(KEY_A), status(KEY_C)) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    finally:
        suite.write_keys(suite.keys_text)
    deadline = time.monotonic() + 10
    while status(KEY_B) != grpc.StatusCode.OK and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status(KEY_B) == grpc.StatusCode.OK


def test_cli_sends_the_api_key_from_the_environment(secure_suite: SecureSuite) -> None:
    suite = secure_suite
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "services.cli", "generate", "The capital of France is", "--max-tokens", "3",
           "--address", suite.address, "--tls-ca", suite.certs.ca]
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_API_KEY"}
    ok = subprocess.run(cmd, env={**env, "KVMESH_API_KEY": KEY_A}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"\n\[[1-3] tokens, prompt 8 \(", ok.stdout), ok.stdout
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "UNAUTHENTICATED" in refused.stderr
