"""Soak: Poisson load on the whole suite while one service (the model-runner, or `--kill`) is SIGKILLed and restarted.

Measures what docs/reliability.md promises: outside the kill windows requests succeed, every
successful answer equals its cold-run answer (greedy, so the cache never changes it), no process's
RSS keeps growing after warm-up, and every block is free at the end.

Run: ``python bench/soak.py [--model DIR | --tiny] [--minutes 10] [--kill-every 120] [--rate 2]``;
writes ``bench/results/soak.json``. ``--tiny`` builds the tests' random-weight checkpoint (fast on
a small CPU machine); the default is the embedded SmolLM2-135M.

Reference answers are computed first, one prompt at a time with a unique cache salt (a cold run:
nothing shared). A request counts *inside a kill window* when it was in flight between the kill
and 2 s after the new runner reported healthy; those may fail (``UNAVAILABLE``) by design.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from services.scheduler.client import KVMeshClient  # noqa: E402
from services.suite import Suite, SuiteConfig  # noqa: E402
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2, kv_cache_manager_pb2_grpc  # noqa: E402

SERVICES = ("kv-cache-manager", "model-runner", "offload-store", "scheduler")
WINDOW_GRACE_S = 2.0


@dataclass
class Outcome:
    """One request of the load."""

    prompt: int
    start: float
    end: float
    code: str  # "OK" or the gRPC status name
    identical: bool
    cached_tokens: int


def _rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and its anonymous / shared-memory parts (KiB) from /proc (0 once the process is gone)."""
    out = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _prompts(vocab: int, n: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    """``n`` prompts: four shared system prefixes, each with its own suffix (prefix caching matters)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(3, vocab) for _ in range(suffix_len)] for i in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_tiny_checkpoint  # the tests' tiny random-weight checkpoint

        model = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="kvmesh-soak-model-"))))
    elif not model:
        from services.model_runner.prepare import default_cache_dir, prepare_default_model

        model = str(prepare_default_model(default_cache_dir(), progress=True))
    env = {
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(args.pool_bytes),
        "KVMESH_SCHED_OWNER_LEASE_SECONDS": "5",
    }
    log_dir = tempfile.mkdtemp(prefix="kvmesh-soak-")
    suite = Suite(SuiteConfig(model_dir=model, scheduler_port=0, with_offload=True, log_dir=log_dir, extra_env=env))
    try:
        return _soak(suite, args, model, log_dir)
    finally:
        suite.stop()


def _soak(suite: Suite, args: argparse.Namespace, model: str, log_dir: str) -> dict[str, Any]:
    with KVMeshClient(suite.address) as client:
        vocab = client.model_info().vocab_size
        prompts = _prompts(vocab, args.prompts, args.prefix_len, args.suffix_len, seed=1)
        reference = [client.complete(p, args.max_tokens, ignore_eos=True, cache_salt=f"cold-{i}")[1]
                     for i, p in enumerate(prompts)]
    t0 = time.monotonic()
    stop = threading.Event()
    outcomes: list[Outcome] = []
    windows: list[tuple[float, float]] = []
    rss: list[dict[str, Any]] = []
    lock = threading.Lock()

    def request(i: int) -> None:
        start = time.monotonic() - t0
        code, cached = "OK", 0
        ids: list[int] = []
        try:
            with KVMeshClient(suite.address) as c:
                _, ids, final = c.complete(prompts[i], args.max_tokens, ignore_eos=True, timeout=120)
                cached = final.cached_tokens
        except grpc.RpcError as exc:
            code = exc.code().name
        with lock:
            outcomes.append(Outcome(i, start, time.monotonic() - t0, code, ids == reference[i], cached))

    def killer() -> None:
        while not stop.wait(args.kill_every):
            begin = time.monotonic() - t0
            suite.restart(args.kill)
            windows.append((begin, time.monotonic() - t0 + WINDOW_GRACE_S))

    def sampler() -> None:
        while not stop.is_set():
            sample: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
            for name in SERVICES:
                if name in suite.services:
                    sample[name] = _rss_kib(suite.services[name].proc.pid)
            rss.append(sample)
            stop.wait(args.sample_every)

    rng = random.Random(2)
    threads = [threading.Thread(target=killer, daemon=True), threading.Thread(target=sampler, daemon=True)]
    for t in threads:
        t.start()
    inflight: list[threading.Thread] = []
    deadline = t0 + args.minutes * 60
    while time.monotonic() < deadline:
        time.sleep(rng.expovariate(args.rate))
        inflight = [t for t in inflight if t.is_alive()]
        if len(inflight) >= args.max_concurrency:
            continue  # the client side is saturated: skip this arrival (counted below)
        t = threading.Thread(target=request, args=(rng.randrange(len(prompts)),), daemon=True)
        t.start()
        inflight.append(t)
    stop.set()
    for t in inflight:
        t.join(180)
    kvm = kv_cache_manager_pb2_grpc.KVCacheManagerStub(
        grpc.insecure_channel(suite.services["kv-cache-manager"].address))
    free_deadline = time.monotonic() + 30
    while True:
        stats = kvm.GetStats(kv_cache_manager_pb2.GetStatsRequest(), timeout=10)
        if stats.num_free_blocks == stats.num_blocks or time.monotonic() > free_deadline:
            break
        time.sleep(0.2)
    return _report(args, model, log_dir, outcomes, windows, rss, stats)


def _report(args: argparse.Namespace, model: str, log_dir: str, outcomes: list[Outcome],
            windows: list[tuple[float, float]], rss: list[dict[str, Any]],
            stats: kv_cache_manager_pb2.KVCacheStats) -> dict[str, Any]:
    def in_window(o: Outcome) -> bool:
        return any(o.start < end and o.end > begin for begin, end in windows)

    outside = [o for o in outcomes if not in_window(o)]
    inside = [o for o in outcomes if in_window(o)]
    after_first_kill = [o for o in outcomes if o.code == "OK" and windows and o.start > windows[0][1]]
    warm = [s for s in rss if s["t"] >= args.warmup_seconds] or rss

    def series(name: str, key: str) -> dict[str, float]:
        values = [s[name][key] / 1024 for s in warm if name in s and s[name][key]]
        return {"first_mb": round(values[0], 1), "max_mb": round(max(values), 1),
                "last_mb": round(values[-1], 1)} if values else {}

    return {
        "model": model, "log_dir": log_dir, "minutes": args.minutes, "rate_per_s": args.rate,
        "killed": args.kill, "kill_every_s": args.kill_every, "max_tokens": args.max_tokens, "kills": len(windows),
        "requests": len(outcomes),
        "outside_windows": {"requests": len(outside), "ok": sum(o.code == "OK" for o in outside),
                            "success_rate": round(sum(o.code == "OK" for o in outside) / max(len(outside), 1), 4)},
        "inside_windows": {"requests": len(inside), "ok": sum(o.code == "OK" for o in inside),
                           "codes": sorted({o.code for o in inside})},
        "ok_not_identical": sum(1 for o in outcomes if o.code == "OK" and not o.identical),
        "ok_after_first_restart": len(after_first_kill),
        "ok_after_first_restart_identical": sum(o.identical for o in after_first_kill),
        "cached_tokens_total": sum(o.cached_tokens for o in outcomes if o.code == "OK"),
        "rss_after_warmup": {name: {key: series(name, key) for key in ("VmRSS", "RssAnon", "RssShmem")}
                             for name in SERVICES},
        "end": {"num_blocks": stats.num_blocks, "num_free_blocks": stats.num_free_blocks,
                "num_requests": stats.num_requests},
        "windows": [[round(b, 1), round(e, 1)] for b, e in windows],
        "outcomes": [asdict(o) for o in outcomes],
        "rss": rss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tiny", action="store_true", help="use the tests' tiny random-weight checkpoint")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs")
    parser.add_argument("--kill", default="model-runner", choices=SERVICES, help="the service SIGKILLed and restarted")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=96)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--pool-bytes", type=int, default=64 << 20, help="the runner's KV pool budget")
    parser.add_argument("--sample-every", type=float, default=2.0, help="RSS sampling period (s)")
    parser.add_argument("--warmup-seconds", type=float, default=20.0, help="RSS before this is warm-up")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    ns = parser.parse_args(argv)
    result = run(ns)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("outcomes", "rss")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
