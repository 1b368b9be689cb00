"""TTFT of a long prompt whose prefix is in the pool, in DRAM, on disk, or nowhere — in one run.

The whole engine runs in-process (scheduler, kv-cache-manager, model-runner and offload-store
cores; the store maps the runner's /dev/shm pool exactly as the service does) on SmolLM2-135M.
For each repetition a fresh salt gives the prompt its own chain of block hashes, then:

  (d) nowhere   first request with that salt: full prefill (recompute)
  (a) pool      the same request again: the pool serves all full blocks (capped at n - 1 tokens)
  (b) DRAM      after a filler of the same length evicted the prefix from the pool (the evicted
                blocks were saved to the store's DRAM tier on the way out)
  (c) disk      the same as (b) with a store whose DRAM tier is disabled (blocks go to disk)
  (e) remote    replica B (a second engine: own pool, DRAM, disk) runs the prompt that replica A
                computed and evicted (saved to A's DRAM and to the shared Redis on the way out):
                B's store finds it only in the remote tier (``--redis-url``; empty: skipped)

Targets (issue): (b) at least 5x faster than (d). The store's raw load/save bandwidth next to a
plain memory copy is measured by ``bench/offload_store_bw.py``.

The remote row also reports the bytes per prompt token B read from Redis next to the formula
``2 x L x H_kv x d_h x bytes`` (K and V, every layer, fp32 here).

Run: ``python bench/offload.py [--model DIR] [--prompt-len 2048] [--repeats 3] [--redis-url URL]``; writes
``bench/results/offload.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.prepare import default_cache_dir, prepare_default_model  # noqa: E402
from services.offload_store.config import OffloadConfig  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.inprocess import InProcessSuite, build_inprocess  # noqa: E402
from services.scheduler.stream import OutputStream, build_spec  # noqa: E402
from shared.hashing import hash_blocks  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


def _ttft(suite: InProcessSuite, prompt: list[int], salt: str) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens served from cache (pool or store)."""
    spec = build_spec(suite.engine, prompt, SamplingParams(ignore_eos=True), 1, cache_salt=salt)
    start = time.perf_counter()
    chunks = iter(OutputStream(suite.engine, spec, None))
    first = next(chunks)
    ttft = time.perf_counter() - start
    final = first.final
    for c in chunks:
        final = c.final or final
    assert final is not None and final.metrics is not None
    return ttft, final.metrics.cached_tokens


def _suite(model: str, pool_blocks: int, block_bytes: int, data: Path, dram: bool, threads: int,
           remote_url: str = "", remote_prefix: str = "") -> InProcessSuite:
    # NOTE: fp32 pinned: ``block_bytes`` (and so the pool size the filler must fill) assumes it, and
    # ``auto`` is bf16 on CPUs with BF16 instructions (docs/model_runner.md).
    rc = RunnerConfig(model_dir=model, kv_cache_memory_bytes=pool_blocks * block_bytes, num_threads=threads,
                      dtype="float32")
    sc = SchedulerConfig(max_num_batched_tokens=4096)
    oc = OffloadConfig(data_dir=str(data), dram_bytes=(2 << 30) if dram else 0, disk_bytes=8 << 30,
                       remote_url=remote_url, remote_key_prefix=remote_prefix, remote_timeout_seconds=5.0)
    return build_inprocess(rc, sc, with_tokenizer=False, offload_config=oc)


def _remote(model: str, pool_blocks: int, block_bytes: int, tmp: Path, threads: int, url: str, prompt: list[int],
            filler: list[int], repeats: int) -> tuple[list[float], int, dict[str, Any]]:
    """(e): replica A computes and evicts, replica B loads from Redis; TTFTs, cached tokens, bytes."""
    import redis

    prefix = f"kvmesh-bench:{uuid.uuid4().hex[:8]}:"
    raw = redis.Redis.from_url(url)
    a = _suite(model, pool_blocks, block_bytes, tmp / "replica-a", True, threads, url, prefix)
    b = _suite(model, pool_blocks, block_bytes, tmp / "replica-b", True, threads, url, prefix)
    times: list[float] = []
    cached = read = 0
    try:
        _ttft(b, prompt[:64], "warmup")
        for rep in range(repeats):
            salt = f"remote-{rep}"
            _ttft(a, prompt, salt)
            _ttft(a, filler, salt + "-filler")  # A's pool evicts the prompt: saved to DRAM + Redis
            assert b.store is not None and b.store.core.remote is not None
            before = b.store.core.remote.stats.bytes_read
            t, cached = _ttft(b, prompt, salt)
            read = b.store.core.remote.stats.bytes_read - before
            times.append(t)
        assert b.store is not None and b.store.core.remote is not None
        stats = b.store.core.remote.stats
        key = next(iter(raw.scan_iter(match=prefix + "*", count=1000)))
        value_bytes = int(raw.strlen(key))  # header + checksum + payload of one block
        return times, cached, {
            "hits": stats.hits, "errors": stats.errors, "round_trips": stats.round_trips,
            "payload_bytes_per_token": read / cached if cached else 0.0,
            "value_bytes_per_token": value_bytes / b.engine.scheduler.block_size,
        }
    finally:
        a.close()
        b.close()
        found = list(raw.scan_iter(match=prefix + "*", count=1000))
        if found:
            raw.delete(*found)
        raw.close()


def run(model: str, prompt_len: int, repeats: int, threads: int, redis_url: str = "") -> dict[str, Any]:
    block_size = 16
    probe = RunnerConfig(model_dir=model)
    from services.model_runner.model.config import ModelConfig

    mcfg = ModelConfig.from_dir(Path(probe.model_dir))
    block_bytes = mcfg.num_layers * 2 * block_size * mcfg.num_kv_heads * mcfg.head_dim * 4
    # Room for the prompt and a little more. The filler (plus its one output token) takes every
    # usable block, so it evicts all of the prompt's cached blocks, head included (heads go last).
    pool_blocks = prompt_len // block_size + 8
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
    filler = torch.randint(100, 40000, ((pool_blocks - 1) * block_size - 1,), generator=g).tolist()
    rows: dict[str, list[float]] = {"nowhere": [], "pool": [], "dram": [], "disk": []}
    cached: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-offload-") as tmp:
        for tier in ("dram", "disk"):
            suite = _suite(model, pool_blocks, block_bytes, Path(tmp) / tier, tier == "dram", threads)
            try:
                _ttft(suite, prompt[:64], "warmup")
                for rep in range(repeats):
                    salt = f"{tier}-{rep}"
                    t, _ = _ttft(suite, prompt, salt)
                    if tier == "dram":  # (d) and (a) are measured once per repetition
                        rows["nowhere"].append(t)
                        t, cached["pool"] = _ttft(suite, prompt, salt)
                        rows["pool"].append(t)
                    _ttft(suite, filler, salt + "-filler")  # evicts the prefix (saved on the way out)
                    hashes = hash_blocks(suite.engine.scheduler.hash_seed, prompt, block_size,
                                         salt.encode())
                    assert suite.manager.lookup_prefix(hashes).num_cached_tokens == 0
                    t, cached[tier] = _ttft(suite, prompt, salt)
                    rows[tier].append(t)
            finally:
                suite.close()
        remote: dict[str, Any] = {}
        if redis_url:
            rows["remote"], cached["remote"], remote = _remote(model, pool_blocks, block_bytes, Path(tmp), threads,
                                                               redis_url, prompt, filler, repeats)
            remote["formula_bytes_per_token"] = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * 4
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": model, "prompt_len": prompt_len, "repeats": repeats, "threads": threads,
        "ttft_seconds": rows, "median_seconds": med, "cached_tokens": cached, "remote": remote,
        "speedup_vs_recompute": {k: med["nowhere"] / med[k] for k in rows if k != "nowhere"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="the shared remote tier for row (e) (empty: skip it)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload.json"))
    ns = parser.parse_args()
    model = ns.model or str(prepare_default_model(default_cache_dir(), progress=True))
    result = run(model, ns.prompt_len, ns.repeats, ns.threads, ns.redis_url)
    print(f"TTFT of a {ns.prompt_len}-token prompt, median of {ns.repeats} (min-max):")
    print(f"{'prefix is':<10} {'TTFT ms':>9} {'min-max ms':>17} {'cached tok':>10} {'vs recompute':>13}")
    for key in [k for k in ("pool", "dram", "disk", "remote", "nowhere") if k in result["ttft_seconds"]]:
        vals = result["ttft_seconds"][key]
        speed = result["speedup_vs_recompute"].get(key, 1.0)
        print(f"{key:<10} {statistics.median(vals) * 1e3:>9.0f} {min(vals) * 1e3:>8.0f}-{max(vals) * 1e3:<8.0f} "
              f"{result['cached_tokens'].get(key, 0):>10} {speed:>12.1f}x")
    if result["remote"]:
        r = result["remote"]
        print(f"remote tier: {r['payload_bytes_per_token']:,.0f} payload B/token read (formula 2 x L x H_kv x d_h x 4 "
              f"= {r['formula_bytes_per_token']:,}), {r['value_bytes_per_token']:,.0f} B/token stored with the header; "
              f"{r['hits']} block hits, {r['round_trips']} round trips, {r['errors']} errors")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
