"""Prefill/decode disaggregation vs two mixed replicas: TTFT and ITL p50/p99, measured apart.

Two meshes of real processes (``services/mesh.py``: router + two whole replicas) on the same
model, run one after the other with the same workload:

  mixed   two ``mixed`` replicas behind the KV-aware router (the mesh of part 1)
  pd      one ``prefill`` and one ``decode`` replica behind the router, offload-stores on the
          shared Redis (``--redis-url``), ``KVMESH_ROUTER_PD_THRESHOLD_TOKENS`` = ``--threshold``

Workload (the claim to test: long prefills no longer stall other streams' ITL):

* ``--streams`` closed-loop workers, each sending short prompts (``--short-len`` tokens, own
  random ids) with ``--stream-tokens`` output tokens, one after the other, for ``--duration`` s;
* one worker sending a long uncached prompt (``--long-len`` random tokens, ``--long-tokens``
  output tokens) every ``--long-every`` s.

Reported per mesh: TTFT p50/p99 of the long prompts and of the short ones, and ITL p50/p99/max of
the short streams (gaps between consecutive streamed tokens, measured at the client), the short
streams' stalls (gaps over ``--stall-ms``: how many, and their total seconds), how many tokens
each kind produced, and how many long prompts were split (trailer ``kvmesh-prefill-replica``)
with the cached tokens their decode leg reported. Greedy, ignore_eos; every prompt is unique (no prefix hits), so
each long prompt is a full prefill somewhere.

Run: ``python bench/pd.py [--model DIR] [--redis-url redis://127.0.0.1:6379/0]``; writes
``bench/results/pd.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from services.mesh import Mesh, MeshConfig  # noqa: E402
from services.model_runner.prepare import default_cache_dir, prepare_default_model  # noqa: E402
from services.scheduler.client import KVMeshClient  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _one(address: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int, bool, int]:
    """(TTFT, inter-token gaps, tokens, split?, cached tokens) of one streamed request, at the client."""
    with KVMeshClient(address) as client:
        start = time.perf_counter()
        stamps: list[float] = []
        n, cached = 0, 0
        call = client.stub.Generate(client.request(prompt, max_tokens, ignore_eos=True), timeout=600)
        for msg in call:
            if msg.token_ids:
                stamps.append(time.perf_counter())
                n += len(msg.token_ids)
            if msg.HasField("final"):
                cached = msg.final.cached_tokens
        split = any(k == "kvmesh-prefill-replica" for k, _ in call.trailing_metadata() or ())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, gaps, n, split, cached


def run_workload(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Streams and long prompts at once for ``args.duration`` seconds."""
    stop = time.monotonic() + args.duration
    lock = threading.Lock()
    out: dict[str, list[float]] = {"short_ttft": [], "short_itl": [], "long_ttft": [], "long_itl": []}
    counts = {"short_tokens": 0, "long_tokens": 0, "short_requests": 0, "long_requests": 0, "long_split": 0,
              "long_cached_tokens": 0}

    def stream_worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            prompt = [rng.randrange(100, 40_000) for _ in range(args.short_len)]
            ttft, gaps, n, _, _ = _one(address, prompt, args.stream_tokens)
            with lock:
                out["short_ttft"].append(ttft)
                out["short_itl"] += gaps
                counts["short_tokens"] += n
                counts["short_requests"] += 1

    def long_worker() -> None:
        rng = random.Random(99)
        time.sleep(args.long_every / 2)  # streams are running by then
        while time.monotonic() < stop:
            due = time.monotonic() + args.long_every
            prompt = [rng.randrange(100, 40_000) for _ in range(args.long_len)]
            ttft, gaps, n, split, cached = _one(address, prompt, args.long_tokens)
            with lock:
                counts["long_split"] += split
                counts["long_cached_tokens"] += cached
                out["long_ttft"].append(ttft)
                out["long_itl"] += gaps
                counts["long_tokens"] += n
                counts["long_requests"] += 1
            time.sleep(max(0.0, due - time.monotonic()))

    threads = [threading.Thread(target=stream_worker, args=(i,)) for i in range(args.streams)]
    threads.append(threading.Thread(target=long_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary: dict[str, Any] = dict(counts)
    for key, xs in out.items():
        summary[f"{key}_p50_ms"] = round(_pct(xs, 0.5) * 1000, 1)
        summary[f"{key}_p99_ms"] = round(_pct(xs, 0.99) * 1000, 1)
        summary[f"{key}_mean_ms"] = round(statistics.fmean(xs) * 1000, 1) if xs else float("nan")
        summary[f"{key}_max_ms"] = round(max(xs, default=float("nan")) * 1000, 1)
    # A stall: a gap of a short stream longer than --stall-ms (a prefill chunk or a load ran in it).
    summary["short_stalls"] = sum(g * 1000 > args.stall_ms for g in out["short_itl"])
    summary["short_stall_seconds"] = round(sum(g for g in out["short_itl"] if g * 1000 > args.stall_ms), 2)
    return summary


def _mesh(model: str, roles: tuple[str, str], args: argparse.Namespace, prefix: str) -> Mesh:
    env = {"KVMESH_RUNNER_DTYPE": "float32", "KVMESH_ROUTER_PD_THRESHOLD_TOKENS": str(args.threshold),
           "KVMESH_ROUTER_READY_TIMEOUT_SECONDS": "120"}
    if "prefill" in roles:
        env |= {"KVMESH_OFFLOAD_REMOTE_URL": args.redis_url, "KVMESH_OFFLOAD_REMOTE_KEY_PREFIX": prefix,
                "KVMESH_OFFLOAD_REMOTE_TIMEOUT_SECONDS": str(args.redis_timeout)}
    return Mesh(MeshConfig(model_dir=model, replicas=2, port=0, roles=roles, extra_env=env, log_dir=args.log_dir),
                startup_timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=6.0)
    ap.add_argument("--threshold", type=int, default=256)
    ap.add_argument("--redis-timeout", type=float, default=0.2, help="KVMESH_OFFLOAD_REMOTE_TIMEOUT_SECONDS")
    ap.add_argument("--stall-ms", type=float, default=250.0, help="a short stream's gap above this is a stall")
    ap.add_argument("--modes", default="mixed,pd")
    ap.add_argument("--log-dir", default="", help="keep the processes' logs here")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd.json"))
    args = ap.parse_args()
    model = args.model or str(prepare_default_model(default_cache_dir()))
    results: dict[str, Any] = {"args": vars(args)}
    for mode in args.modes.split(","):
        roles = ("prefill", "decode") if mode == "pd" else ("mixed", "mixed")
        prefix = f"kvmesh-bench:pd:{uuid.uuid4().hex[:8]}:"
        with _mesh(model, roles, args, prefix) as mesh:
            _one(mesh.address, [7] * 8, 2)  # warm both paths' first call
            results[mode] = run_workload(mesh.address, args)
        if mode == "pd":
            import redis

            client = redis.Redis.from_url(args.redis_url)
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
        print(mode, json.dumps(results[mode]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
