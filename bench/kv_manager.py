"""Benchmark of the kv-cache-manager: per-request cost in-process and per-step cost over gRPC.

Workload: ``--requests`` prompts of ``--prompt-len`` tokens (block size 16) sharing 0%, 50% and
97% of their tokens as a common prefix (same salt), the rest random; a pool of ``--num-blocks``.

In-process, one request at a time (vLLM's per-request view):
  hash      ``shared.hashing.hash_blocks`` over the prompt (timed alone: the scheduler's call; the
            manager never hashes, it is sent the hashes)
  alloc     one ``step`` admitting the request: validation, prefix lookup, allocation, registration
            of the computed full blocks; ``lookup+allocate`` = alloc
  free      ``free`` of that request
Batched, as the scheduler calls it: steps of ``--step-size`` new requests, each step also freeing
the previous step's requests; the same steps in-process and as one AllocateSlots RPC to the real
service process (both timings include building the step's input: AllocationSpec objects or the
protobuf request). RPC overhead per step = gRPC step - in-process step. A decode row adds the
steady state: the same batch of running requests appending one token each, step after step.

NOTE: two clocks. Wall-clock medians are what a caller waits on an idle machine, but on a shared
one they mostly measure other processes. CPU time does not: in-process it is the thread's CPU
time; over gRPC it is the client process's CPU time plus the server process's (all its threads,
from /proc/<pid>/task/*/schedstat), which is the RPC path's critical path when the machine is
idle (client and server work one after the other). The table shows both.

Reference (vLLM v1, this CPU class): ~200 µs to hash a 512-token request with SHA-256, 100-150 µs
to look it up and allocate, 10-16 µs to free; < 2 ms RPC overhead per 64-request step.

Run: ``python bench/kv_manager.py``; writes ``bench/results/kv_manager.json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from services.kv_cache_manager.config import CacheConfig  # noqa: E402
from services.kv_cache_manager.manager import KVCacheManager  # noqa: E402
from services.kv_cache_manager.types import AllocationSpec  # noqa: E402
from shared.hashing import BlockHash, hash_blocks, hash_seed  # noqa: E402
from shared.launcher import ServiceProcess  # noqa: E402
from shared.owner_channel import with_owner  # noqa: E402
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2 as pb  # noqa: E402
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 32000
Batch = list[tuple[str, list[int]]]


def workload(num: int, prompt_len: int, share: float, seed: int) -> list[list[int]]:
    """``num`` prompts whose first ``round(share * prompt_len)`` tokens are common."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(round(share * prompt_len))]
    return [shared + [rng.randrange(VOCAB) for _ in range(prompt_len - len(shared))] for _ in range(num)]


def batches(prompts: list[list[int]], step_size: int) -> list[Batch]:
    items = [(f"r{i}", tokens) for i, tokens in enumerate(prompts)]
    return [items[i : i + step_size] for i in range(0, len(items), step_size)]


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of another process, in ns (schedstat's first field)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return total


SEED = hash_seed(b"bench", "bench")  # the scheduler's seed: this benchmark plays the scheduler


@functools.lru_cache(maxsize=4096)
def _hashes(tokens: tuple[int, ...]) -> tuple[BlockHash, ...]:
    return tuple(hash_blocks(SEED, tokens, BLOCK_SIZE))


def prompt_hashes(tokens: list[int]) -> tuple[BlockHash, ...]:
    """The prompt's full-block hashes, as the scheduler sends them (memoised: not the manager's cost)."""
    return _hashes(tuple(tokens))


def new_spec(rid: str, tokens: list[int]) -> AllocationSpec:
    """A whole prompt's first allocation, hashes included."""
    return AllocationSpec(rid, tuple(tokens), len(tokens), is_new=True, block_hashes=prompt_hashes(tokens))


def per_request(prompts: list[list[int]], config: CacheConfig) -> dict[str, float]:
    """Admit then free each request alone; median CPU microseconds per phase."""
    manager = KVCacheManager(config)
    seed = SEED
    clock = time.thread_time_ns
    hash_ns: list[int] = []
    alloc_ns: list[int] = []
    free_ns: list[int] = []
    hit_tokens = 0
    for i, tokens in enumerate(prompts):
        rid = f"r{i}"
        t0 = clock()
        hashes = tuple(hash_blocks(seed, tokens, BLOCK_SIZE))
        t1 = clock()
        result = manager.step((), [AllocationSpec(rid, tuple(tokens), len(tokens), is_new=True,
                                                  block_hashes=hashes)])
        t2 = clock()
        manager.free([rid])
        t3 = clock()
        hash_ns.append(t1 - t0)
        alloc_ns.append(t2 - t1)
        free_ns.append(t3 - t2)
        hit_tokens += result.results[0].num_cached_tokens
    manager.check_integrity()
    hash_us = statistics.median(hash_ns) / 1e3
    alloc_us = statistics.median(alloc_ns) / 1e3
    free_us = statistics.median(free_ns) / 1e3
    return {
        "hash_us": hash_us,
        "lookup_allocate_us": alloc_us,
        "alloc_step_us": alloc_us,
        "free_us": free_us,
        "total_us": alloc_us + free_us,
        "requests_per_s": 1e6 / (alloc_us + free_us),
        "hit_rate": hit_tokens / sum(len(p) for p in prompts),
    }


def run_steps(
    prompts: list[list[int]],
    step_size: int,
    repeat: int,
    reset: Callable[[], None],
    do_step: Callable[[list[str], Batch], None],
    cpu_ns: Callable[[], int],
) -> dict[str, float]:
    """Median wall and CPU milliseconds per step over ``repeat`` runs, each on a fresh pool."""
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeat):
        reset()
        previous: list[str] = []
        for batch in batches(prompts, step_size):
            c0 = cpu_ns()
            t0 = time.perf_counter_ns()
            do_step(previous, batch)
            t1 = time.perf_counter_ns()
            cpu.append((cpu_ns() - c0) / 1e6)
            wall.append((t1 - t0) / 1e6)
            previous = [rid for rid, _ in batch]
        do_step(previous, [])
    return {"step_ms": statistics.median(wall), "step_cpu_ms": statistics.median(cpu)}


def steps_in_process(prompts: list[list[int]], config: CacheConfig, step_size: int, repeat: int) -> dict[str, float]:
    holder: list[KVCacheManager] = []

    def reset() -> None:
        holder[:] = [KVCacheManager(config)]

    def do_step(free: list[str], batch: Batch) -> None:
        specs = [new_spec(rid, tokens) for rid, tokens in batch]
        holder[0].step(free, specs)

    out = run_steps(prompts, step_size, repeat, reset, do_step, time.thread_time_ns)
    holder[0].check_integrity()
    return out


def steps_grpc(
    stub: pb_grpc.KVCacheManagerStub,
    server_pid: int,
    prompts: list[list[int]],
    config: CacheConfig,
    step_size: int,
    repeat: int,
) -> dict[str, float]:
    def reset() -> None:
        init = pb.InitializeRequest(
            num_blocks=config.num_blocks, block_size=config.block_size, max_model_len=config.max_model_len,
            lease_seconds=600,
        )
        stub.Initialize(init, timeout=30)

    def do_step(free: list[str], batch: Batch) -> None:
        request = pb.AllocateSlotsRequest(free_request_ids=free)
        add = request.allocations.add  # NOTE: ~2x faster than a list of constructed messages
        for rid, tokens in batch:
            add(request_id=rid, new_token_ids=tokens, num_new_tokens=len(tokens), is_new=True, use_prefix_cache=True,
                block_hashes=prompt_hashes(tokens))
        stub.AllocateSlots(request, timeout=30)

    def both_cpu_ns() -> int:
        return time.process_time_ns() + process_cpu_ns(server_pid)

    out = run_steps(prompts, step_size, repeat, reset, do_step, both_cpu_ns)
    out["step_cpu_ms"] -= proc_probe_ms(both_cpu_ns)
    stub.CheckIntegrity(pb.CheckIntegrityRequest(), timeout=30)
    return out


Decode = tuple[str, int, tuple[BlockHash, ...]]  # request id, sampled token, hash of the block it completes


def decode_tokens(batch: Batch, num_steps: int) -> list[list[Decode]]:
    """One sampled token per request per step, with the hash the scheduler sends when it fills a block."""
    rng = random.Random(7)
    known = {rid: list(tokens) for rid, tokens in batch}
    steps: list[list[Decode]] = []
    for _ in range(num_steps):
        step: list[Decode] = []
        for rid, _ in batch:
            tokens = known[rid]
            tokens.append(rng.randrange(VOCAB))
            full = len(tokens) // BLOCK_SIZE
            fresh = tuple(hash_blocks(SEED, tokens, BLOCK_SIZE)[full - 1 :]) if len(tokens) % BLOCK_SIZE == 0 else ()
            step.append((rid, tokens[-1], fresh))
        steps.append(step)
    return steps


def time_steps(
    run_step: Callable[[list[Decode]], None], steps: list[list[Decode]], cpu_ns: Callable[[], int]
) -> dict[str, float]:
    wall: list[float] = []
    cpu: list[float] = []
    for step in steps:
        c0 = cpu_ns()
        t0 = time.perf_counter_ns()
        run_step(step)
        t1 = time.perf_counter_ns()
        cpu.append((cpu_ns() - c0) / 1e6)
        wall.append((t1 - t0) / 1e6)
    return {"step_ms": statistics.median(wall), "step_cpu_ms": statistics.median(cpu)}


def decode_in_process(batch: Batch, steps: list[list[Decode]], config: CacheConfig) -> dict[str, float]:
    """Decode steps of a running batch, in-process."""
    manager = KVCacheManager(config)
    manager.step((), [new_spec(rid, tokens) for rid, tokens in batch])

    def run_step(step: list[Decode]) -> None:
        manager.step((), [AllocationSpec(rid, (token,), 1, block_hashes=h) for rid, token, h in step])

    out = time_steps(run_step, steps, time.thread_time_ns)
    manager.check_integrity()
    return out


def decode_grpc(
    stub: pb_grpc.KVCacheManagerStub,
    server_pid: int,
    batch: Batch,
    steps: list[list[Decode]],
    config: CacheConfig,
) -> dict[str, float]:
    """The same decode steps, one AllocateSlots RPC each."""
    stub.Initialize(pb.InitializeRequest(num_blocks=config.num_blocks, block_size=config.block_size,
                                         max_model_len=config.max_model_len, lease_seconds=600), timeout=30)
    admit = pb.AllocateSlotsRequest()
    for rid, tokens in batch:
        admit.allocations.add(
            request_id=rid, new_token_ids=tokens, num_new_tokens=len(tokens), is_new=True, use_prefix_cache=True,
            block_hashes=prompt_hashes(tokens),
        )
    stub.AllocateSlots(admit, timeout=30)

    def run_step(step: list[Decode]) -> None:
        request = pb.AllocateSlotsRequest()
        add = request.allocations.add
        for rid, token, h in step:
            add(request_id=rid, new_token_ids=(token,), num_new_tokens=1, block_hashes=h)
        stub.AllocateSlots(request, timeout=30)

    def both_cpu_ns() -> int:
        return time.process_time_ns() + process_cpu_ns(server_pid)

    out = time_steps(run_step, steps, both_cpu_ns)
    out["step_cpu_ms"] -= proc_probe_ms(both_cpu_ns)
    stub.Free(pb.FreeRequest(request_ids=[rid for rid, _ in batch]), timeout=30)
    stub.CheckIntegrity(pb.CheckIntegrityRequest(), timeout=30)
    return out


def proc_probe_ms(cpu_ns: Callable[[], int]) -> float:
    """CPU cost of one reading of ``cpu_ns`` itself (reading /proc costs the client CPU too)."""
    probe = [cpu_ns() for _ in range(21)]
    return statistics.median(b - a for a, b in itertools.pairwise(probe)) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--step-size", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=4097, help="pool size, including the null block")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 0.97])
    parser.add_argument("--repeat", type=int, default=3, help="runs of the batched steps per share")
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps of one running batch")
    parser.add_argument("--no-grpc", action="store_true", help="skip the service process")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_manager.json")
    args = parser.parse_args(argv)
    config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.num_blocks, max_model_len=max(args.prompt_len, 2048))
    workloads = {f"{s:.2f}": workload(args.requests, args.prompt_len, s, seed=1) for s in args.shares}
    warm = workload(200, args.prompt_len, 0.5, seed=99)
    decode_batch = batches(workload(args.step_size, args.prompt_len, 0.5, seed=3), args.step_size)[0]
    decode_steps = decode_tokens(decode_batch, args.decode_steps)

    results: dict[str, dict[str, Any]] = {}
    per_request(warm, config)
    for share, prompts in workloads.items():
        results[share] = {
            "in_process": {
                **per_request(prompts, config),
                **steps_in_process(prompts, config, args.step_size, args.repeat),
            }
        }
    results["decode"] = {"in_process": decode_in_process(decode_batch, decode_steps, config)}

    if not args.no_grpc:
        env: dict[str, str] = {}  # the manager reads no geometry: Initialize brings it
        with ServiceProcess("kv-cache-manager", env=env) as proc, grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.KVCacheManagerStub(with_owner(channel, "bench"))
            steps_grpc(stub, proc.proc.pid, warm, config, args.step_size, 1)
            for share, prompts in workloads.items():
                g = steps_grpc(stub, proc.proc.pid, prompts, config, args.step_size, args.repeat)
                local = results[share]["in_process"]
                g["rpc_overhead_ms"] = g["step_ms"] - local["step_ms"]
                g["rpc_overhead_cpu_ms"] = g["step_cpu_ms"] - local["step_cpu_ms"]
                g["requests_per_s"] = args.step_size * 1e3 / g["step_ms"]
                results[share]["grpc"] = g
            g = decode_grpc(stub, proc.proc.pid, decode_batch, decode_steps, config)
            local = results["decode"]["in_process"]
            g["rpc_overhead_ms"] = g["step_ms"] - local["step_ms"]
            g["rpc_overhead_cpu_ms"] = g["step_cpu_ms"] - local["step_cpu_ms"]
            g["requests_per_s"] = args.step_size * 1e3 / g["step_ms"]
            results["decode"]["grpc"] = g

    print_table(results, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {
                    "requests": args.requests,
                    "prompt_len": args.prompt_len,
                    "block_size": BLOCK_SIZE,
                    "step_size": args.step_size,
                    "num_blocks": args.num_blocks,
                    "repeat": args.repeat,
                    "decode_steps": args.decode_steps,
                    "cpu_count": os.cpu_count(),
                    "load_avg_1m": os.getloadavg()[0],
                },
                "results": results,
            },
            indent=2,
        )
    )
    print(f"\nwritten to {args.out}")
    return 0


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"kv-cache-manager: {args.requests} requests x {args.prompt_len} tokens, block size {BLOCK_SIZE}, "
        f"pool {args.num_blocks - 1} blocks; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print("in-process, per request (median CPU µs; req/s on one core)")
    print(f"{'shared':>7} {'hit':>6} {'hash':>7} {'lookup+alloc':>13} {'free':>6} {'total':>7} {'req/s':>7}")
    for share, row in results.items():
        if share == "decode":
            continue
        r = row["in_process"]
        print(
            f"{float(share):>7.0%} {r['hit_rate']:>6.1%} {r['hash_us']:>7.1f} {r['lookup_allocate_us']:>13.1f} "
            f"{r['free_us']:>6.1f} {r['total_us']:>7.1f} {r['requests_per_s']:>7.0f}"
        )
    print(f"\nper step of {args.step_size} requests (median ms; wall / CPU)")
    print(f"{'step':>13} {'in-process':>13} {'gRPC':>13} {'RPC overhead':>13} {'gRPC req/s':>11}")
    for share, row in results.items():
        label = "decode, +1" if share == "decode" else f"new, {float(share):.0%}"
        r, g = row["in_process"], row.get("grpc")
        local = f"{r['step_ms']:.2f} / {r['step_cpu_ms']:.2f}"
        if g is None:
            print(f"{label:>13} {local:>13}")
            continue
        remote = f"{g['step_ms']:.2f} / {g['step_cpu_ms']:.2f}"
        overhead = f"{g['rpc_overhead_ms']:.2f} / {g['rpc_overhead_cpu_ms']:.2f}"
        print(f"{label:>13} {local:>13} {remote:>13} {overhead:>13} {g['requests_per_s']:>11.0f}")


if __name__ == "__main__":
    sys.exit(main())
