"""The offload tiers in the router's score, with real processes: ``kvmesh up --replicas 2`` (two
whole suites with their offload-stores, block size 4, a 16-block pool each) behind the router,
which follows each replica's offload-store events (services/mesh.py names them in its list).

A prefix that replica r0 computed and then evicted from its pool into its DRAM tier (requests
sent straight to r0's scheduler, so the router's predictions play no part) is routed to r0, not
to the idle r1 that holds nothing: the offload credit is the only difference between them. r0
reports the prefix as cached (loaded from its DRAM), and the greedy tokens equal the cold run's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.mesh import Mesh, MeshConfig
from services.scheduler.client import KVMeshClient
from shared.pb.kvmesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2

pytestmark = pytest.mark.slow  # two suites with offload-stores and a router: nine processes

BS = 4
KEY = "offload-route-test-key"
KEYS = {"team-a": "sk-offroute-team-a-0001"}
AUTH = (("authorization", f"Bearer {KEYS['team-a']}"),)


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    logs = tmp_path_factory.mktemp("offload-mesh")
    keys_file = logs / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    env = {"KVMESH_DEPLOYMENT_KEY": KEY, "KVMESH_AUTH_KEYS_FILE": str(keys_file),
           "KVMESH_RUNNER_BLOCK_SIZE": str(BS), "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(17 * 2048),
           "KVMESH_RUNNER_WARMUP": "0",
           "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20),
           "KVMESH_ROUTER_HEALTH_INTERVAL_SECONDS": "0.2", "KVMESH_ROUTER_READY_TIMEOUT_SECONDS": "30"}
    with Mesh(MeshConfig(model_dir=str(tiny_llama_dir), replicas=2, port=0, with_offload=True,
                         log_dir=str(logs), extra_env=env)) as m:
        yield m


def generate(address: str, prompt: list[int],
             max_tokens: int = 4) -> tuple[list[int], scheduler_pb2.GenerateFinal, str]:
    """(tokens, final, replica) of one greedy request through ``address``."""
    with KVMeshClient(address, api_key=KEYS["team-a"]) as client:
        call = client.stub.Generate(client.request(prompt, max_tokens, ignore_eos=True),
                                    metadata=client.metadata, timeout=60)
        msgs = list(call)
        trailers = dict(call.trailing_metadata() or ())
    return [t for m in msgs for t in m.token_ids], msgs[-1].final, str(trailers.get("kvmesh-replica", ""))


def explain(mesh: Mesh, prompt: list[int]) -> router_pb2.RouteDecision:
    req = scheduler_pb2.GenerateRequest(max_tokens=1)
    req.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(mesh.address) as channel:
        return router_pb2_grpc.RouterStub(channel).Explain(req, metadata=AUTH)


def prompt(seed: int, n: int = 32) -> list[int]:
    return [(seed * 53 + i * 17) % 340 + 9 for i in range(n)]


def test_a_prefix_evicted_into_dram_is_routed_to_its_holder(mesh: Mesh) -> None:
    r0 = mesh.suites[0].address
    with grpc.insecure_channel(mesh.address) as channel:
        states = router_pb2_grpc.RouterStub(channel).GetReplicas(router_pb2.GetReplicasRequest(),
                                                                 metadata=AUTH).replicas
    assert [(s.id, s.offload_address != "", s.offload_subscribed) for s in states] == [("r0", True, True),
                                                                                      ("r1", True, True)]
    p = prompt(1)
    cold, first, _ = generate(r0, p)
    assert first.cached_tokens == 0
    for seed in (2, 3):  # 16 blocks of other prompts: every block of p is evicted, i.e. saved to DRAM
        generate(r0, prompt(seed))
    deadline = time.monotonic() + 10
    # The events and the load probe are asynchronous: wait until the router sees p in r0's DRAM
    # (not its pool) and both replicas idle (a stale KV-usage probe would add its own cost term).
    while True:
        d = explain(mesh, [*p])
        scores = {s.id: s for s in d.scores}
        idle = all(s.kv_usage == 0 and s.in_flight == 0 for s in d.scores)
        if idle and scores["r0"].matched_blocks == 0 and scores["r0"].dram_blocks == d.total_blocks:
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.05)
    r0s, r1s = scores["r0"], scores["r1"]
    assert (r1s.matched_blocks, r1s.dram_blocks, r1s.disk_blocks, r1s.remote_blocks) == (0, 0, 0, 0)
    assert d.total_blocks == 8 and r0s.cost == pytest.approx(r1s.cost - 0.5 * 8)  # DRAM weight 0.5
    tokens, final, replica = generate(mesh.address, p)
    assert replica == "r0" and tokens == cold
    assert final.cached_tokens == 28  # 7 blocks loaded from DRAM: the last block holds the token to compute
