"""Simulated mesh at scale: the real router (hashes, index, scorer) over N real kv-cache-manager
cores, no model, for N = 2 ... 64 replicas (docs/benchmarks-mesh.md).

What is real: each replica is an in-process :class:`KVCacheManager` (prefix hits, allocation,
LRU eviction) publishing its KV events into an :class:`EventHub`; the router's
:class:`PrefixIndex` consumes them (drained after every operation: zero event lag) and the
router's :class:`Scorer` with its default weights picks the replica, from hashes computed by
``services/router/prefix.py`` with each tenant's salt. What is modelled: time. A replica
prefills one request at a time (``--prefill-ms-per-token`` x tokens not cached) and decodes
concurrently (``--decode-ms-per-step`` x output tokens); a request holds its prompt's blocks
from the start of its prefill to its last token and waits, FIFO, while its replica's pool cannot
take it. The costs are inputs, not measurements: pass the per-token prefill and per-step decode
times ``bench/model_runner.py`` measures on the target machine.

Trace: ``8 x N`` groups (each a tenant's ``--prefix-len``-token system prompt) with Zipf(1.0)
popularity, a random user suffix of 32-256 tokens, ``--output-len`` output tokens, Poisson
arrivals at ``--load`` x the mesh's modelled capacity. Per policy (``round_robin``,
``kv_aware``) and N: prefix hit rate (cached / prompt tokens), prefill tokens computed, load
imbalance (max / mean requests per replica, and of prefill tokens), modelled TTFT p50 / p99.
``ideal`` is one pool with all N pools' blocks serving the whole trace (hit rate only: the
upper bound of what routing can reach).

Run: ``python bench/mesh_sim.py [--replicas 2 4 8 16 32 64] [--write docs/benchmarks-mesh.md]``.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub, Subscription
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationSpec, AllocationStatus
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.prefix import request_hashes
from services.router.scoring import Scorer
from services.router.types import ReplicaLoad
from shared.auth import tenant_cache_salt
from shared.hashing import hash_blocks, hash_seed

KEY, MODEL, BS = "mesh-sim-key", "mesh-sim-model", 16


@dataclass(frozen=True)
class Req:
    rid: str
    arrival: float
    tenant: str
    tokens: tuple[int, ...]
    output_len: int


@dataclass
class Replica:
    rid: str
    manager: KVCacheManager
    sub: Subscription
    waiting: deque[tuple[Req, float]] = field(default_factory=deque)
    prefilling: bool = False
    running: int = 0
    served: int = 0
    prefill_tokens: int = 0

    def load(self) -> ReplicaLoad:
        stats = self.manager.stats()
        usage = (stats.num_blocks - stats.num_free_blocks) / stats.num_blocks
        return ReplicaLoad(len(self.waiting) + self.running + int(self.prefilling), usage)


def make_trace(n: int, args: argparse.Namespace, rate: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    groups = 8 * n
    prefixes = [(f"tenant-{g % (2 * n)}", tuple(rng.randrange(5, 50_000) for _ in range(args.prefix_len)))
                for g in range(groups)]
    weights = [1.0 / (g + 1) for g in range(groups)]
    t, out = 0.0, []
    for i in range(args.requests_per_replica * n):
        t += rng.expovariate(rate)
        tenant, prefix = rng.choices(prefixes, weights)[0]
        suffix = tuple(rng.randrange(5, 50_000) for _ in range(rng.randrange(32, 257)))
        out.append(Req(f"q{i}", t, tenant, prefix + suffix, args.output_len))
    return out


def new_manager(num_blocks: int, hub: EventHub | None) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks + 1, max_model_len=8192,
                                      model_id=MODEL), hub)


def salt(tenant: str) -> bytes:
    return tenant_cache_salt(KEY, tenant)


def first_allocation(req: Req) -> AllocationSpec:
    """A whole prompt's allocation, with the hashes its replica's scheduler would send."""
    hashes = hash_blocks(hash_seed(KEY.encode(), MODEL), req.tokens, BS, salt(req.tenant))
    return AllocationSpec(req.rid, req.tokens, len(req.tokens), is_new=True, block_hashes=tuple(hashes))


def simulate(n: int, policy: str, trace: Sequence[Req], args: argparse.Namespace) -> dict[str, float]:
    index, scorer = PrefixIndex(), Scorer(RouterConfig(policy=policy))
    replicas = []
    for i in range(n):
        hub = EventHub(max_pending=1 << 20)
        replicas.append(Replica(f"r{i}", new_manager(args.blocks_per_replica, hub), hub.subscribe()))
    ids = [r.rid for r in replicas]
    by_id = {r.rid: r for r in replicas}
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    events: list[tuple[float, int, str, str, Req]] = []  # (time, tiebreak, kind, replica, request)
    counter = 0

    def drain(r: Replica) -> None:
        while (batch := r.sub.get(timeout=0)) is not None:
            if not index.apply(r.rid, batch):
                raise RuntimeError("event gap in the simulator")

    def push(t: float, kind: str, rid: str, req: Req) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, rid, req))

    def try_start(r: Replica, now: float) -> None:
        nonlocal prompt_tokens, cached_tokens
        if r.prefilling or not r.waiting:
            return
        req, arrived = r.waiting[0]
        res = r.manager.step([], [first_allocation(req)]).results[0]
        drain(r)
        if res.status != AllocationStatus.OK:
            return  # the pool is full: wait for a finish
        r.waiting.popleft()
        cached = res.num_computed_tokens
        prompt_tokens += len(req.tokens)
        cached_tokens += cached
        r.prefill_tokens += len(req.tokens) - cached
        r.prefilling = True
        done = now + (len(req.tokens) - cached) * args.prefill_ms_per_token / 1000
        ttfts.append(done - arrived)
        push(done, "prefilled", r.rid, req)

    for req in trace:
        push(req.arrival, "arrive", "", req)
    while events:
        now, _, kind, rid, req = heapq.heappop(events)
        if kind == "arrive":
            hashes_for = request_hashes(KEY, MODEL, BS, req.tokens, req.tenant)
            decision = scorer.decide(len(hashes_for), ids, index.match(hashes_for, ids),
                                     {r.rid: r.load() for r in replicas})
            r = by_id[decision.replica_id]
            r.waiting.append((req, now))
            r.served += 1
            try_start(r, now)
        elif kind == "prefilled":
            r = by_id[rid]
            r.prefilling, r.running = False, r.running + 1
            push(now + req.output_len * args.decode_ms_per_step / 1000, "finish", rid, req)
            try_start(r, now)
        else:
            r = by_id[rid]
            r.running -= 1
            r.manager.free([req.rid])
            drain(r)
            try_start(r, now)
    served = [r.served for r in replicas]
    prefill = [r.prefill_tokens for r in replicas]
    ttfts.sort()
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "prefill_tokens": float(sum(prefill)),
        "imbalance_requests": max(served) / statistics.mean(served),
        "imbalance_prefill": max(prefill) / statistics.mean(prefill) if sum(prefill) else 1.0,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[int(len(ttfts) * 0.99)],
    }


def ideal_hit_rate(n: int, trace: Sequence[Req], args: argparse.Namespace) -> float:
    """One pool with every replica's blocks, requests one after another (prefix reuse only)."""
    m = new_manager(args.blocks_per_replica * n, None)
    prompt = cached = 0
    for req in trace:
        res = m.step([], [first_allocation(req)]).results[0]
        prompt += len(req.tokens)
        cached += res.num_computed_tokens
        m.free([req.rid])
    return cached / prompt


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--requests-per-replica", type=int, default=100)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--blocks-per-replica", type=int, default=1024, help="pool size (16-token blocks)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.5)
    p.add_argument("--decode-ms-per-step", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.7, help="arrival rate / modelled mesh capacity (cold)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", default="", help="write the markdown table here")
    args = p.parse_args(argv)
    mean_prompt = args.prefix_len + 144
    rows = []
    for n in args.replicas:
        # Capacity: one prefill at a time per replica, at the cold (no-hit) cost.
        rate = args.load * n / (mean_prompt * args.prefill_ms_per_token / 1000)
        trace = make_trace(n, args, rate, args.seed)
        ideal = ideal_hit_rate(n, trace, args)
        for policy in ("round_robin", "kv_aware"):
            r = simulate(n, policy, trace, args)
            rows.append((n, policy, r, ideal))
            print(f"N={n:<3} {policy:<12} hit {r['hit_rate']:.3f} (ideal {ideal:.3f})  prefill "
                  f"{r['prefill_tokens']:.0f}  imbalance req {r['imbalance_requests']:.2f} prefill "
                  f"{r['imbalance_prefill']:.2f}  TTFT p50 {r['ttft_p50'] * 1000:.0f} ms p99 "
                  f"{r['ttft_p99'] * 1000:.0f} ms", flush=True)
    if args.write:
        write_markdown(args.write, rows, args)
    return 0


def write_markdown(path: str, rows: list[tuple[int, str, dict[str, float], float]], args: argparse.Namespace) -> None:
    lines = [
        "# Mesh at scale, by simulation (`bench/mesh_sim.py`)",
        "",
        "Generated by `python bench/mesh_sim.py --write docs/benchmarks-mesh.md` (see the module docstring for",
        "what is real and what is modelled). The router's index, scorer and hashing and the kv-cache-managers are",
        "the real code; time is modelled: prefill "
        f"{args.prefill_ms_per_token} ms/token (one at a time per replica), decode {args.decode_ms_per_step} ms/step,",
        f"{args.blocks_per_replica} blocks of 16 tokens per replica. Trace: 8 x N groups of {args.prefix_len}-token",
        f"system prompts (2 x N tenants, Zipf popularity), 32-256-token user suffixes, {args.output_len} output",
        f"tokens, {args.requests_per_replica} x N requests, Poisson arrivals at {args.load} x the cold capacity.",
        "*ideal* = one pool with all N pools' blocks (hit rate's upper bound). Imbalance = max / mean over",
        "replicas (requests routed; prefill tokens computed).",
        "",
        "| N | policy | hit rate | ideal | prefill tokens | vs round-robin | imbalance (requests) | "
        "imbalance (prefill) | TTFT p50 (ms) | TTFT p99 (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rr: dict[int, float] = {}
    for n, policy, r, ideal in rows:
        if policy == "round_robin":
            rr[n] = r["prefill_tokens"]
        ratio = rr[n] / r["prefill_tokens"] if r["prefill_tokens"] else float("inf")
        lines.append(f"| {n} | {policy} | {r['hit_rate']:.3f} | {ideal:.3f} | {r['prefill_tokens']:.0f} | "
                     f"{ratio:.2f}x fewer | {r['imbalance_requests']:.2f} | {r['imbalance_prefill']:.2f} | "
                     f"{r['ttft_p50'] * 1000:.0f} | {r['ttft_p99'] * 1000:.0f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
