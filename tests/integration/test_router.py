"""Two real replicas (two suites on ephemeral ports) behind the router as a process.

One module-scoped mesh, started as ``kvmesh up --replicas 2`` starts it (services/mesh.py):
replicas r0 and r1 (block size 4, a 64-block pool each, API keys for two tenants) behind a
``kv_aware`` router, plus a ``round_robin`` router in front of the same replicas. The
tests run in file order; the last one kills r1's scheduler under load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.mesh import Mesh, MeshConfig
from services.scheduler.client import KVMeshClient
from services.suite import Suite
from shared.auth import tenant_cache_salt
from shared.hashing import hash_blocks, hash_seed
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc
from shared.pb.kvmesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2

BS = 4
KEY = "mesh-test-deployment-key"
KEYS = {"team-a": "sk-mesh-team-a-0000001", "team-b": "sk-mesh-team-b-0000001"}
AUTH = (("authorization", f"Bearer {KEYS['team-a']}"),)  # the Router API is behind the same keys


@dataclass
class Replicas:
    mesh: Mesh  # r0, r1 and the kv_aware router, as `kvmesh up --replicas 2` starts them
    rr_router: ServiceProcess
    router_env: dict[str, str]  # what another router in front of r0, r1 needs (with a policy)

    @property
    def suites(self) -> list[Suite]:
        return self.mesh.suites

    @property
    def router(self) -> ServiceProcess:
        assert self.mesh.router is not None
        return self.mesh.router

    def kvm(self, i: int) -> kvm_grpc.KVCacheManagerStub:
        return kvm_grpc.KVCacheManagerStub(grpc.insecure_channel(self.suites[i].services["kv-cache-manager"].address))

    def admin(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(grpc.insecure_channel(self.router.address))


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    logs = tmp_path_factory.mktemp("mesh")
    keys_file = logs / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    env = {"KVMESH_DEPLOYMENT_KEY": KEY, "KVMESH_AUTH_KEYS_FILE": str(keys_file),
           "KVMESH_RUNNER_BLOCK_SIZE": str(BS), "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(65 * 2048),
           "KVMESH_RUNNER_WARMUP": "0", "KVMESH_ROUTER_HEALTH_INTERVAL_SECONDS": "0.2",
           "KVMESH_ROUTER_READY_TIMEOUT_SECONDS": "30"}
    with Mesh(MeshConfig(model_dir=str(tiny_llama_dir), replicas=2, port=0, with_offload=False,
                         log_dir=str(logs), extra_env=env)) as m:
        assert m.router is not None
        router_env = {**env, "KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_ROUTER_REPLICAS": ",".join(
            f"r{i}={s.address}/{s.services['kv-cache-manager'].address}" for i, s in enumerate(m.suites))}
        rr = ServiceProcess("router", log_dir=str(logs / "round_robin"),
                            env={**router_env, "KVMESH_ROUTER_POLICY": "round_robin"})
        try:
            yield Replicas(m, rr, router_env)
        finally:
            rr.stop()


def generate(address: str, prompt: list[int] | str | list[tuple[str, str]], tenant: str = "team-a", max_tokens: int = 4,
             **kw: object) -> tuple[list[int], scheduler_pb2.GenerateFinal, str]:
    """(tokens, final, replica) of one request through ``address``."""
    with KVMeshClient(address, api_key=KEYS[tenant]) as client:
        call = client.stub.Generate(client.request(prompt, max_tokens, ignore_eos=True, **kw),  # type: ignore[arg-type]
                                    metadata=client.metadata, timeout=30)
        msgs = list(call)
        trailers = dict(call.trailing_metadata() or ())
    return [t for m in msgs for t in m.token_ids], msgs[-1].final, str(trailers.get("kvmesh-replica", ""))


def explain(mesh: Replicas, prompt: list[int], tenant: str = "team-a",
            admin: router_pb2_grpc.RouterStub | None = None) -> dict[str, int]:
    """The router's matched blocks per replica for ``prompt`` (routes nothing)."""
    req = scheduler_pb2.GenerateRequest(max_tokens=1)
    req.token_ids.ids.extend(prompt)
    d = (admin or mesh.admin()).Explain(req, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),))
    return {s.id: s.matched_blocks for s in d.scores}


def scheduler_hashes(mesh: Replicas, prompt: list[int], tenant: str) -> list[bytes]:
    """The hashes a replica's scheduler (the seed's owner) sends for ``prompt``, but the last token's block."""
    with KVMeshClient(mesh.suites[0].address, api_key=KEYS[tenant]) as client:
        model_id = client.stub.GetModelInfo(scheduler_pb2.SchedulerModelInfoRequest(), metadata=client.metadata,
                                            timeout=30).model_id
    hashes = hash_blocks(hash_seed(KEY.encode(), model_id), prompt, BS, tenant_cache_salt(KEY, tenant))
    return list(hashes[: (len(prompt) - 1) // BS])


def wait_index_caught_up(mesh: Replicas, timeout: float = 10.0) -> None:
    """Until the router's entry count per replica equals the replica's cached blocks (events are async)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {r.id: r for r in mesh.admin().GetReplicas(router_pb2.GetReplicasRequest(), metadata=AUTH).replicas}
        truth = {f"r{i}": mesh.kvm(i).GetStats(kvm_pb2.GetStatsRequest()).num_cached_blocks for i in range(2)}
        if all(states[r].num_indexed_blocks == n for r, n in truth.items()):
            return
        assert time.monotonic() < deadline, f"index {[(r.id, r.num_indexed_blocks) for r in states.values()]} " \
                                            f"vs pools {truth}"
        time.sleep(0.05)


def wait_router_sees_idle(mesh: Replicas, timeout: float = 10.0) -> None:
    """Until the router's last probe of every replica shows an idle pool and no open stream.

    NOTE: KV usage is a periodic probe's value; without this a replica busy at its last probe
    stays "more loaded" for up to one health interval and wins no tie until the next probe.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = mesh.admin().GetReplicas(router_pb2.GetReplicasRequest(), metadata=AUTH).replicas
        if all(r.kv_usage == 0 and r.in_flight == 0 for r in states):
            return
        assert time.monotonic() < deadline, [(r.id, r.kv_usage, r.in_flight) for r in states]
        time.sleep(0.02)


def prefix(seed: int, n: int = 48) -> list[int]:
    return [(seed * 37 + i * 11) % 360 + 5 for i in range(n)]


def test_shared_prefix_lands_on_its_holder_and_round_robin_misses(mesh: Replicas) -> None:
    p = prefix(1)
    _, first, home = generate(mesh.router.address, [*p, 1, 2, 3])
    assert first.cached_tokens == 0 and home in ("r0", "r1")
    wait_index_caught_up(mesh)
    for i in range(4):
        _, final, replica = generate(mesh.router.address, [*p, 10 + i, 2, 3])
        assert (replica, final.cached_tokens) == (home, 48), i
    q = prefix(2)
    placed: list[str] = []
    for i in range(4):
        _, final, replica = generate(mesh.rr_router.address, [*q, 10 + i, 2, 3])
        assert final.cached_tokens == (48 if replica in placed else 0), (i, placed)
        placed.append(replica)
    assert placed in (["r0", "r1", "r0", "r1"], ["r1", "r0", "r1", "r0"])


def test_tenants_stay_isolated_across_replicas(mesh: Replicas) -> None:
    p = prefix(3)
    _, _, home = generate(mesh.router.address, [*p, 1], tenant="team-a")
    wait_index_caught_up(mesh)
    assert explain(mesh, [*p, 2], "team-a")[home] == 12
    assert set(explain(mesh, [*p, 2], "team-b").values()) == {0}
    _, final_b, _ = generate(mesh.router.address, [*p, 2], tenant="team-b")
    assert final_b.cached_tokens == 0
    _, final_a, replica = generate(mesh.router.address, [*p, 3], tenant="team-a")
    assert (replica, final_a.cached_tokens) == (home, 48)


def test_text_and_chat_prompts_are_hashed_as_the_replica_hashes_them(mesh: Replicas) -> None:
    chat = [("system", "KV caches keep keys and values of past tokens so decoding reads them instead. " * 3),
            ("user", "The capital of France is Paris.")]
    with KVMeshClient(mesh.router.address, api_key=KEYS["team-b"]) as via_router, \
            KVMeshClient(mesh.suites[0].address, api_key=KEYS["team-b"]) as direct:
        assert via_router.model_info() == direct.model_info()
        tok = scheduler_pb2.TokenizeRequest(chat=via_router.request(chat, 4).chat)
        ids = list(via_router.stub.Tokenize(tok, metadata=via_router.metadata).token_ids)
        assert ids == list(direct.stub.Tokenize(tok, metadata=direct.metadata).token_ids) and len(ids) > 40
        detok = scheduler_pb2.DetokenizeRequest(token_ids=ids)
        assert via_router.stub.Detokenize(detok, metadata=via_router.metadata).text == \
            direct.stub.Detokenize(detok, metadata=direct.metadata).text != ""
        _, _, home = generate(mesh.router.address, chat, tenant="team-b")
        wait_index_caught_up(mesh)
        req = via_router.request(chat, 4)
        predicted = mesh.admin().Explain(req, metadata=(("authorization", f"Bearer {KEYS['team-b']}"),))
        _, final, replica = generate(mesh.router.address, chat, tenant="team-b")
    assert (predicted.replica_id, replica) == (home, home)
    assert predicted.matched_blocks * BS == final.cached_tokens == (len(ids) - 1) // BS * BS


def test_greedy_output_equals_a_single_replicas(mesh: Replicas) -> None:
    prompts = [[*prefix(4), i, i + 1, i + 2] for i in range(6)] + [[*prefix(5, 30), i] for i in range(4)]
    direct = [generate(mesh.suites[0].address, p, max_tokens=6, cache_salt=f"cold-{i}")[0]
              for i, p in enumerate(prompts)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = generate(mesh.router.address, prompts[i], max_tokens=6)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == direct


def test_index_equals_the_replicas_hashed_blocks_after_churn(mesh: Replicas) -> None:
    # 12 prompts of 13 blocks on 64-block pools: both replicas evict.
    prompts = [[*prefix(10 + i, 52), 1] for i in range(12)]
    before = [mesh.kvm(i).GetStats(kvm_pb2.GetStatsRequest()).num_evictions for i in range(2)]
    for i, p in enumerate(prompts):
        wait_router_sees_idle(mesh)  # each decision a pure tie: the rotation alternates the replicas
        generate(mesh.router.address, p, tenant=("team-a", "team-b")[i % 2], max_tokens=2)
    after = [mesh.kvm(i).GetStats(kvm_pb2.GetStatsRequest()).num_evictions for i in range(2)]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    wait_index_caught_up(mesh)
    for i, p in enumerate(prompts):
        tenant = ("team-a", "team-b")[i % 2]
        # NOTE: not the owner: the manager says how many tokens are cached, not in which blocks.
        query = kvm_pb2.LookupPrefixRequest(block_hashes=scheduler_hashes(mesh, p, tenant))
        truth = {f"r{j}": mesh.kvm(j).LookupPrefix(query).num_cached_tokens // BS for j in range(2)}
        assert explain(mesh, p, tenant) == truth, i


def pool_truth(mesh: Replicas, prompt: list[int], tenant: str) -> dict[str, int]:
    """Blocks of ``prompt`` each replica's pool holds, from its kv-cache-manager."""
    # NOTE: not the owner: the manager says how many tokens are cached, not in which blocks.
    query = kvm_pb2.LookupPrefixRequest(block_hashes=scheduler_hashes(mesh, prompt, tenant))
    return {f"r{j}": mesh.kvm(j).LookupPrefix(query).num_cached_tokens // BS for j in range(2)}


def test_a_router_started_late_knows_the_warm_pools_from_their_snapshots(
        mesh: Replicas, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A router that subscribes after the pools filled saw none of their events: its index comes
    from each kv-cache-manager's GetCachedBlocks, and equals the pools before any new traffic."""
    cached = {f"r{i}": mesh.kvm(i).GetStats(kvm_pb2.GetStatsRequest()).num_cached_blocks for i in range(2)}
    assert all(cached.values()), cached
    logs = tmp_path_factory.mktemp("late-router")
    with ServiceProcess("router", log_dir=str(logs), env={**mesh.router_env, "KVMESH_ROUTER_POLICY": "kv_aware"}) \
            as late, grpc.insecure_channel(late.address) as channel:
        admin = router_pb2_grpc.RouterStub(channel)
        states = admin.GetReplicas(router_pb2.GetReplicasRequest(), metadata=AUTH).replicas
        assert {r.id: r.num_indexed_blocks for r in states} == cached
        assert all(r.subscribed and r.subscriptions == 1 for r in states)
        for i in range(12):  # the churn test's prompts: some still cached, some evicted since
            p, tenant = [*prefix(10 + i, 52), 1], ("team-a", "team-b")[i % 2]
            assert explain(mesh, p, tenant, admin) == pool_truth(mesh, p, tenant), i
    assert cached == {f"r{i}": mesh.kvm(i).GetStats(kvm_pb2.GetStatsRequest()).num_cached_blocks for i in range(2)}


def test_a_replica_killed_under_load_is_skipped_and_nothing_leaks_on_the_survivor(mesh: Replicas) -> None:
    """Four long streams (distinct cold prompts: the open-stream cost spreads them two and two),
    then one replica's scheduler is SIGKILLed while all four are decoding. Its streams end with
    UNAVAILABLE (no replay after the first token), the survivor's finish whole, every new request
    is served by the survivor (a forward to the dead one fails before its first token and is
    retried), and the survivor's pool is whole again: no live request, every block free."""
    n, max_tokens = 4, 120
    wait_router_sees_idle(mesh)
    calls, clients, streams, first = [], [], [], []
    for i in range(n):  # one at a time: each decision sees the streams already open
        client = KVMeshClient(mesh.router.address, api_key=KEYS["team-a"])
        clients.append(client)
        calls.append(client.stub.Generate(client.request([*prefix(40 + i), 1], max_tokens, ignore_eos=True),
                                          metadata=client.metadata, timeout=120))
        streams.append(iter(calls[-1]))
        first.append(next(streams[-1]))
    assert all(f.token_ids for f in first)
    states = {r.id: r for r in mesh.admin().GetReplicas(router_pb2.GetReplicasRequest(), metadata=AUTH).replicas}
    assert (states["r0"].in_flight, states["r1"].in_flight) == (2, 2)
    victim = 1
    mesh.suites[victim].services["scheduler"].proc.kill()
    outcomes: list[tuple[str, int]] = []
    for call, stream, head in zip(calls, streams, first, strict=True):
        count = len(head.token_ids)
        try:
            for msg in stream:
                count += len(msg.token_ids)
            outcomes.append((str(dict(call.trailing_metadata() or ()).get("kvmesh-replica")), count))
        except grpc.RpcError as exc:
            outcomes.append((exc.code().name, count))
    for client in clients:
        client.close()
    # The replica's status, passed on; the survivor's streams complete.
    assert sorted(o[0] for o in outcomes) == ["UNAVAILABLE", "UNAVAILABLE", "r0", "r0"], outcomes
    assert all(count == max_tokens for rid, count in outcomes if rid == "r0")
    assert all(0 < count < max_tokens for rid, count in outcomes if rid == "UNAVAILABLE")
    # Before or after the probe notices, every new request is served by the survivor.
    for i in range(3):
        tokens, final, replica = generate(mesh.router.address, [*prefix(40 + i), 3 + i])
        assert (replica, len(tokens), final.completion_tokens) == ("r0", 4, 4)
    deadline = time.monotonic() + 5
    while True:
        states = {r.id: r for r in mesh.admin().GetReplicas(router_pb2.GetReplicasRequest(), metadata=AUTH).replicas}
        if not states["r1"].healthy:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert states["r0"].healthy and states["r0"].in_flight == 0
    kvm = mesh.kvm(0)
    deadline = time.monotonic() + 5
    while kvm.GetStats(kvm_pb2.GetStatsRequest()).num_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = kvm.GetStats(kvm_pb2.GetStatsRequest())
    assert (stats.num_requests, stats.num_free_blocks) == (0, stats.num_blocks)  # nothing leaked
    kvm.CheckIntegrity(kvm_pb2.CheckIntegrityRequest())
