"""Prefill/decode disaggregation with real processes: a router in front of one ``prefill`` and one
``decode`` replica (two whole suites, tiny model, block size 4) whose offload-stores share the real
Redis at 127.0.0.1:6379 under a key prefix of this module's own.

The reference answer is one mixed replica's cold run: the same request sent straight to the decode
replica's scheduler (``decode`` behaves as ``mixed``) with a cache salt no other request uses, so
it shares no block with anything. The tests run in file order; the last ones take the prefill
replica's offload-store and then its scheduler away.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.client import KVMeshClient
from services.suite import METRICS_PORT_OFFSETS, Suite, SuiteConfig
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import router_pb2_grpc, scheduler_pb2
from tests.integration.ports import free_port_range

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # two suites and a router: nine processes

BS = 4
KEY = "pd-test-deployment-key"
KEYS = {"team-a": "sk-pd-team-a-00000001", "team-b": "sk-pd-team-b-00000001"}
AUTH = (("authorization", f"Bearer {KEYS['team-a']}"),)  # the Router API is behind the same keys
THRESHOLD = 16  # tokens: a 48-token prompt is split, an 8-token one is not


@dataclass
class PD:
    prefill: Suite
    decode: Suite
    router: ServiceProcess
    prefill_metrics: int
    decode_metrics: int
    router_metrics: int
    prefix: str

    def counter(self, port: int, name: str) -> float:
        """The sum of a scheduler counter's samples (all labels)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def pd_outcomes(self) -> dict[str, float]:
        """The router's kvmesh:router_pd_requests_total by outcome."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.router_metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvmesh:router_pd_requests_total"}

    def tokens_served(self) -> tuple[float, float]:
        """(prefill replica's, decode replica's) generated tokens so far."""
        name = "kvmesh:generation_tokens_total"
        return self.counter(self.prefill_metrics, name), self.counter(self.decode_metrics, name)


@pytest.fixture(scope="module")
def pd(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str | None) -> Iterator[PD]:
    if redis_url is None:
        pytest.skip("no Redis server answers at 127.0.0.1:6379")
    logs = tmp_path_factory.mktemp("pd")
    keys_file = logs / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    prefix = f"kvmesh-test:pd:{uuid.uuid4().hex[:12]}:"
    env = {"KVMESH_DEPLOYMENT_KEY": KEY, "KVMESH_AUTH_KEYS_FILE": str(keys_file),
           "KVMESH_RUNNER_BLOCK_SIZE": str(BS), "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(65 * 2048),
           "KVMESH_RUNNER_WARMUP": "0",
           "KVMESH_OFFLOAD_DRAM_BYTES": str(1 << 20), "KVMESH_OFFLOAD_REMOTE_URL": redis_url,
           "KVMESH_OFFLOAD_REMOTE_KEY_PREFIX": prefix}
    ports = [free_port_range(), free_port_range(), free_port_range(1)]
    suites: list[Suite] = []
    router: ServiceProcess | None = None
    try:
        for role, port in zip(("prefill", "decode"), ports[:2], strict=True):
            suites.append(Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0,
                                            log_dir=str(logs / role), metrics_port=port,
                                            extra_env={**env, "KVMESH_SCHED_ROLE": role})))
        p, d = suites
        # NOTE: a long health interval, so the router still believes in a killed prefill replica
        # and the last test exercises leg 1 failing (not the probe taking it out first).
        router = ServiceProcess("router", log_dir=str(logs / "router"), env={
            **env, "KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_ROUTER_HEALTH_INTERVAL_SECONDS": "60",
            "KVMESH_ROUTER_READY_TIMEOUT_SECONDS": "30", "KVMESH_ROUTER_PD_THRESHOLD_TOKENS": str(THRESHOLD),
            "KVMESH_METRICS_PORT": str(ports[2]),
            "KVMESH_ROUTER_REPLICAS": f"p={p.address}/{p.services['kv-cache-manager'].address}/prefill/"
                                      f"{p.services['offload-store'].address},"
                                      f"d={d.address}/{d.services['kv-cache-manager'].address}/decode/"
                                      f"{d.services['offload-store'].address}"})
        yield PD(p, d, router, ports[0] + METRICS_PORT_OFFSETS["scheduler"],
                 ports[1] + METRICS_PORT_OFFSETS["scheduler"], ports[2], prefix)
    finally:
        if router is not None:
            router.stop()
        for s in reversed(suites):
            s.stop()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def generate(address: str, prompt: list[int], tenant: str = "team-a", max_tokens: int = 6, **kw: object
             ) -> tuple[list[int], scheduler_pb2.GenerateFinal, dict[str, str]]:
    """(tokens, final, trailers) of one request through ``address``; exactly one final chunk."""
    with KVMeshClient(address, api_key=KEYS[tenant]) as client:
        call = client.stub.Generate(client.request(prompt, max_tokens, ignore_eos=True, **kw),  # type: ignore[arg-type]
                                    metadata=client.metadata, timeout=60)
        msgs = list(call)
        trailers = {k: str(v) for k, v in call.trailing_metadata() or ()}
    assert [m.HasField("final") for m in msgs].count(True) == 1 and msgs[-1].HasField("final")
    return [t for m in msgs for t in m.token_ids], msgs[-1].final, trailers


def reference(pd: PD, prompt: list[int], max_tokens: int = 6, **kw: object) -> list[int]:
    """One mixed replica's cold answer (the decode replica, a cache salt nobody else uses)."""
    tokens, final, _ = generate(pd.decode.address, prompt, max_tokens=max_tokens,
                                cache_salt=f"ref-{uuid.uuid4().hex}", **kw)
    assert final.cached_tokens == 0
    return tokens


def prompt(seed: int, n: int = 48) -> list[int]:
    return [(seed * 41 + i * 13) % 350 + 7 for i in range(n)]


def test_long_prompt_is_prefilled_there_and_decoded_here_from_redis(pd: PD) -> None:
    p = prompt(1)
    want = reference(pd, p)
    (pre0, dec0), keys0 = pd.tokens_served(), redis.Redis.from_url("redis://127.0.0.1:6379").keys(pd.prefix + "*")
    tokens, final, trailers = generate(pd.router.address, p)
    assert tokens == want
    assert (trailers["kvmesh-prefill-replica"], trailers["kvmesh-replica"]) == ("p", "d")
    # The decode leg's prompt is the 48 tokens + the first one: 12 full blocks, all loaded from Redis.
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (48, 6, 48)
    pre1, dec1 = pd.tokens_served()
    assert (pre1 - pre0, dec1 - dec0) == (1, 5)  # the prefill replica served exactly its one token
    keys1 = redis.Redis.from_url("redis://127.0.0.1:6379").keys(pd.prefix + "*")
    assert len(keys1) - len(keys0) == 12  # published eagerly: nothing was evicted anywhere
    assert pd.pd_outcomes() == {"split": 1, "refused": 0, "prefill_failed": 0}


def test_short_prompt_skips_the_prefill_pool(pd: PD) -> None:
    p = prompt(2, 8)
    want = reference(pd, p)
    pre0, _ = pd.tokens_served()
    tokens, final, trailers = generate(pd.router.address, p)
    assert tokens == want and "kvmesh-prefill-replica" not in trailers and trailers["kvmesh-replica"] == "d"
    assert (final.prompt_tokens, final.cached_tokens) == (8, 0)
    assert pd.tokens_served()[0] == pre0
    assert pd.pd_outcomes() == {"split": 1, "refused": 0, "prefill_failed": 0}  # short: not counted


def test_seeded_sampling_goes_whole(pd: PD) -> None:
    p = prompt(3)
    kw = {"temperature": 0.9, "seed": 1234}
    want = reference(pd, p, **kw)
    pre0, _ = pd.tokens_served()
    tokens, _, trailers = generate(pd.router.address, p, **kw)
    assert tokens == want and "kvmesh-prefill-replica" not in trailers
    assert pd.tokens_served()[0] == pre0
    assert pd.pd_outcomes() == {"split": 1, "refused": 1, "prefill_failed": 0}


def test_tenant_b_is_never_served_tenant_a_blocks(pd: PD) -> None:
    p = prompt(4)
    want = reference(pd, p)
    _, final_a, trailers = generate(pd.router.address, p, tenant="team-a")
    assert trailers["kvmesh-prefill-replica"] == "p" and final_a.cached_tokens == 48
    # A's blocks are now in Redis, in the decode replica's pool and DRAM: B's prompt hashes differ.
    tokens_b, final_b, _ = generate(pd.decode.address, p, tenant="team-b")
    assert tokens_b == want and final_b.cached_tokens == 0


def test_a_prompt_already_published_is_not_prefilled_again(pd: PD) -> None:
    """The prefill replica published a prompt's blocks (asked directly, as another router would);
    the router learns it from that replica's offload-store events, so a longer prompt with the same
    48-token prefix is only 8 tokens uncached on the decode replica (below the threshold of 16):
    it goes whole to the decode replica, which loads the prefix from Redis, and leg 1 is skipped."""
    p = prompt(7)
    longer = [*p, *prompt(8, 8)]
    want = reference(pd, longer)
    _, published, _ = generate(pd.prefill.address, p, max_tokens=1)
    assert published.cached_tokens == 0
    with grpc.insecure_channel(pd.router.address) as channel:
        admin = router_pb2_grpc.RouterStub(channel)
        req = scheduler_pb2.GenerateRequest(max_tokens=6)
        req.token_ids.ids.extend(longer)
        deadline = time.monotonic() + 10
        while True:  # until p's 12 remote blocks reached the router's index (events are asynchronous)
            scores = {s.id: s for s in admin.Explain(req, metadata=AUTH).scores}
            if scores["d"].remote_blocks == 12:
                break
            assert time.monotonic() < deadline, scores
            time.sleep(0.05)
    assert (scores["d"].matched_blocks, scores["d"].dram_blocks, scores["d"].disk_blocks) == (0, 0, 0)
    before, (pre0, _) = pd.pd_outcomes(), pd.tokens_served()
    tokens, final, trailers = generate(pd.router.address, longer)
    assert tokens == want and "kvmesh-prefill-replica" not in trailers and trailers["kvmesh-replica"] == "d"
    assert (final.prompt_tokens, final.cached_tokens) == (56, 48)  # the published prefix, from Redis
    assert pd.tokens_served()[0] == pre0 and pd.pd_outcomes() == before  # no leg 1, not counted as a split


def test_remote_tier_miss_is_recomputed(pd: PD) -> None:
    pd.prefill.services["offload-store"].stop()  # the prefill replica can no longer publish
    p = prompt(5)
    want = reference(pd, p)
    pre0, _ = pd.tokens_served()
    tokens, final, trailers = generate(pd.router.address, p)
    assert tokens == want and trailers["kvmesh-prefill-replica"] == "p"
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (48, 6, 0)
    assert pd.tokens_served()[0] == pre0 + 1


def test_killed_prefill_replica_is_recomputed_by_the_decode_replica(pd: PD) -> None:
    p = prompt(6)
    want = reference(pd, p)
    sched = pd.prefill.services["scheduler"].proc
    sched.kill()  # SIGKILL: no drain, the router learns it from the failed first leg
    sched.wait()
    before = pd.pd_outcomes()
    tokens, final, _ = generate(pd.router.address, p)
    assert tokens == want
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (48, 6, 0)
    after = pd.pd_outcomes()
    assert (after["split"] - before["split"], after["prefill_failed"] - before["prefill_failed"]) == (1, 1)
