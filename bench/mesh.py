"""Two real replicas behind the real router: round-robin vs kv-aware vs one replica with both pools.

Every system is started fresh (cold caches, zeroed counters) as ``kvmesh up --replicas N`` starts
it (services/mesh.py: real processes, the router in front of every system so each pays the same
hop):

- ``round_robin``: 2 replicas, the router's ``round_robin`` policy (a plain load balancer);
- ``kv_aware``: the same 2 replicas, the router's default policy (prefix index + load);
- ``ideal``: 1 replica whose pool has the 2 pools' blocks together (the hit-rate upper bound).

Workload (seeded, identical for the three): ``--groups`` groups, each a tenant's
``--prefix-len``-token system prompt (tenant = group mod ``--tenants``, isolated by its cache
salt), uniform group popularity, a 0.5x-1.5x ``--suffix-len`` user suffix, ``--output-len``
greedy tokens, Poisson arrivals at ``--rate`` requests/s (bench/serve's driver).

Measured, not estimated: the prefix hit rate and the prefill tokens computed come from each
replica's kv-cache-manager counters (``GetStats`` before and after: tokens looked up, tokens
hit, recompute after preemption included), TTFT and throughput from the client's clock. The
greedy outputs of the three systems are compared request by request (the cache never changes
the answer). Offload is off: the comparison is of the pools.

Run: ``python bench/mesh.py [--model DIR] [--requests 128] [--rate 3] [--write docs/benchmarks-mesh.md]``
(without ``--model``: a random-weight Llama of 4 layers x 256, built in a temp folder).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.serve.datasets import Conversation, Turn  # noqa: E402
from bench.serve.driver import Driver, DriverConfig, RequestRecord  # noqa: E402
from bench.serve.metrics import summarize  # noqa: E402
from bench.serve.transports import GrpcTransport  # noqa: E402
from services.mesh import Mesh, MeshConfig  # noqa: E402
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as kvm_pb2  # noqa: E402
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as kvm_grpc  # noqa: E402

BS = 16
SYSTEMS = (("round_robin", 2, "round_robin"), ("kv_aware", 2, "kv_aware"), ("ideal", 1, "kv_aware"))
MODEL_DIMS = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)


def build_model(folder: Path) -> Path:
    """The tests' tokenizer (tests/conftest.py) with a larger random-weight Llama (prefill costs something)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from conftest import build_tiny_checkpoint  # type: ignore[import-not-found]
    from transformers import AutoConfig, AutoModelForCausalLM

    build_tiny_checkpoint(folder)
    config = AutoConfig.from_pretrained(folder)
    for k, v in MODEL_DIMS.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread the logits: greedy is not a string of near-ties
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def block_bytes(model_dir: Path) -> int:
    """KV bytes of one block (fp32 pool on CPU): layers x (K, V) x block x kv heads x head dim x 4."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BS * cfg["num_key_value_heads"] * head_dim * 4


@dataclass(frozen=True)
class Workload:
    conversations: list[Conversation]
    vocab_size: int


def workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The seeded multi-tenant prefix trace (the same for every system)."""
    rng = random.Random(args.seed)
    low = vocab_size // 4  # skip the low ids, where special tokens live
    systems = [tuple(rng.randrange(low, vocab_size) for _ in range(args.prefix_len)) for _ in range(args.groups)]
    convs = []
    for i in range(args.requests):
        g = rng.randrange(args.groups)
        n = rng.randint(max(1, args.suffix_len // 2), args.suffix_len * 3 // 2)
        suffix = tuple(rng.randrange(low, vocab_size) for _ in range(n))
        convs.append(Conversation(i, (Turn((*systems[g], *suffix), args.output_len),),
                                  cache_salt=f"tenant-{g % args.tenants}"))
    return Workload(convs, vocab_size)


def kvm_counters(mesh: Mesh) -> list[dict[str, int]]:
    """Each replica's kv-cache-manager counters (cumulative since it started)."""
    out = []
    for suite in mesh.suites:
        with grpc.insecure_channel(suite.services["kv-cache-manager"].address) as ch:
            s = kvm_grpc.KVCacheManagerStub(ch).GetStats(kvm_pb2.GetStatsRequest(), timeout=10)
        out.append({"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                    "recompute_queries": s.recompute_queries, "recompute_hits": s.recompute_hits,
                    "num_blocks": s.num_blocks, "num_free_blocks": s.num_free_blocks,
                    "num_requests": s.num_requests, "evictions": s.num_evictions})
    return out


def run_system(name: str, replicas: int, policy: str, model_dir: Path, wl: Workload,
               args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Starts one system, warms it, runs the trace, reads the counters, stops it."""
    blocks = args.blocks_per_replica * (2 if name == "ideal" else 1)
    # float32: the exact mode, where the cache never changes greedy tokens (bf16, the default on
    # AMX machines, is not cache-invariant: docs/model_runner.md); it also sizes the pool exactly.
    env = {"KVMESH_RUNNER_BLOCK_SIZE": str(BS), "KVMESH_RUNNER_WARMUP": "0", "KVMESH_RUNNER_DTYPE": "float32",
           "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str((blocks + 1) * block_bytes(model_dir)),
           "KVMESH_RUNNER_NUM_THREADS": str(args.threads)}
    logs = tempfile.mkdtemp(prefix=f"kvmesh-bench-mesh-{name}-")
    print(f"[{name}] starting {replicas} replica(s), {blocks} blocks each (logs {logs})", file=sys.stderr)
    with Mesh(MeshConfig(model_dir=str(model_dir), replicas=replicas, port=0, policy=policy, with_offload=False,
                         log_dir=logs, extra_env=env)) as mesh:
        transport = GrpcTransport(mesh.address)
        try:
            rng = random.Random(1234)
            warm = [Conversation(-1 - i, (Turn(tuple(rng.randrange(96, wl.vocab_size) for _ in range(40)), 4),),
                                 cache_salt="warm-up") for i in range(4)]
            Driver(transport, DriverConfig(progress=False, max_concurrency=1)).run(warm)
            before = kvm_counters(mesh)
            bench = Driver(transport, DriverConfig(request_rate=args.rate, seed=args.seed, progress=True))
            result = bench.run(wl.conversations)
            after = kvm_counters(mesh)
        finally:
            transport.close()
    summary = summarize(result.records, result.duration)
    delta = [{k: a[k] - b[k] for k in ("queries", "hits", "recompute_queries", "recompute_hits")}
             for a, b in zip(after, before, strict=True)]
    queries = sum(d["queries"] for d in delta)
    hits = sum(d["hits"] for d in delta)
    computed = [d["queries"] - d["hits"] + d["recompute_queries"] - d["recompute_hits"] for d in delta]
    row = {
        "system": name, "replicas": replicas, "blocks_per_replica": after[0]["num_blocks"],
        "hit_rate": hits / queries if queries else 0.0, "prefill_tokens": sum(computed),
        "prefill_tokens_per_replica": computed, "prompt_tokens_looked_up": queries,
        "client_hit_rate": summary.prefix_cache_hit_rate, "completed": summary.completed, "failed": summary.failed,
        "ttft_p50_ms": summary.ttft_ms.median, "ttft_p99_ms": summary.ttft_ms.p99,
        "output_tok_s": summary.output_throughput, "requests_s": summary.request_throughput,
        "duration_s": result.duration, "preemptions": summary.preemptions,
        "leaked_requests": sum(a["num_requests"] for a in after),
        "all_blocks_free": all(a["num_free_blocks"] == a["num_blocks"] for a in after),
    }
    return row, result.records


def report(rows: list[dict[str, Any]], differing: int, args: argparse.Namespace) -> str:
    by = {r["system"]: r for r in rows}
    rr, kv, ideal = by["round_robin"], by["kv_aware"], by["ideal"]
    lines = [
        "| system | replicas x blocks | hit rate | of ideal | prefill tokens computed | vs round-robin "
        "| per replica | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | req/s |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['replicas']} x {r['blocks_per_replica']} | {r['hit_rate']:.3f} "
            f"| {r['hit_rate'] / ideal['hit_rate']:.1%} | {r['prefill_tokens']} "
            f"| {rr['prefill_tokens'] / max(r['prefill_tokens'], 1):.2f}x fewer "
            f"| {' / '.join(str(c) for c in r['prefill_tokens_per_replica'])} | {r['ttft_p50_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} |")
    ok_hit = kv["hit_rate"] >= 0.95 * ideal["hit_rate"]
    ok_prefill = rr["prefill_tokens"] >= 3 * kv["prefill_tokens"]
    lines += [
        "",
        f"Targets: kv-aware hit rate {kv['hit_rate'] / ideal['hit_rate']:.1%} of the ideal's (>= 95%: "
        f"{'met' if ok_hit else 'NOT met'}); {rr['prefill_tokens'] / max(kv['prefill_tokens'], 1):.2f}x fewer "
        f"prefill tokens than round-robin (>= 3x: {'met' if ok_prefill else 'NOT met'}). Greedy outputs "
        f"identical across the three systems, request by request: "
        f"{'yes' if differing == 0 else f'NO ({differing} of {args.requests} differ)'}. "
        f"Failed requests: {sum(r['failed'] for r in rows)}; after each run every pool's blocks were free: "
        f"{'yes' if all(r['all_blocks_free'] for r in rows) else 'NO'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF model folder (default: a random-weight 4 x 256 Llama)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals, requests/s")
    p.add_argument("--blocks-per-replica", type=int, default=192,
                   help="pool of each of the 2 replicas (the ideal gets twice as many)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model-runner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/results/mesh.json")
    p.add_argument("--write", default="", help="append the table to this markdown file")
    args = p.parse_args(argv)
    model_dir = Path(args.model) if args.model else build_model(Path(tempfile.mkdtemp(prefix="kvmesh-bench-model-")))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    wl = workload(args, vocab)
    rows, outputs = [], {}
    for name, replicas, policy in SYSTEMS:
        row, records = run_system(name, replicas, policy, model_dir, wl, args)
        rows.append(row)
        outputs[name] = {r.conversation_id: r.output_token_ids for r in records if r.success}
        print(json.dumps(row), file=sys.stderr)
    differing = sum(1 for i in range(args.requests)  # a failed request counts as differing
                    if any(i not in outputs[n] for n in outputs) or len({tuple(outputs[n][i]) for n in outputs}) != 1)
    table = report(rows, differing, args)
    print(table)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "differing_outputs": differing}, indent=2))
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
