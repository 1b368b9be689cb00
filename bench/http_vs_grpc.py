"""The same workload through the OpenAI HTTP gateway and through the scheduler's gRPC API, in one run.

    python bench/http_vs_grpc.py --num-prompts 16 --input-len 128 --output-len 32 --max-concurrency 4

Starts one suite with its gateway, then alternates ``bench serve --backend grpc`` and
``--backend openai`` runs (which goes first alternates too, so drift on a shared machine hits both
alike), and prints a Markdown table of the medians over ``--repeats``: output throughput, TTFT,
TPOT, ITL and E2EL p50, and HTTP's ratio to gRPC.

NOTE: every run draws its own random prompts (its own seed). With one seed for both, the second
run of a pair found the first one's prompts in the prefix cache, and its TTFT looked 4x better
for a reason that has nothing to do with the protocol; the table's last row shows the hit rate.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve.datasets import WorkloadOptions
from bench.serve.driver import DriverConfig
from bench.serve.metrics import Summary
from bench.serve.run import ServeOptions, run_serve
from services.bench_cli import default_model_dir
from services.suite import Suite, SuiteConfig

ROWS = (
    ("output throughput (tok/s)", lambda s: s.output_throughput, True),
    ("TTFT p50 (ms)", lambda s: s.ttft_ms.median, False),
    ("TPOT p50 (ms)", lambda s: s.tpot_ms.median, False),
    ("ITL p50 (ms)", lambda s: s.itl_ms.median, False),
    ("E2EL p50 (ms)", lambda s: s.e2el_ms.median, False),
    ("prefix cache hit rate (%)", lambda s: s.prefix_cache_hit_rate * 100.0, False),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="checkpoint folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    ns = p.parse_args(argv)
    model = str(Path(ns.model).resolve()) if ns.model else default_model_dir()
    env = {"KVMESH_RUNNER_WARMUP": "1", "KVMESH_RUNNER_ATTENTION_BACKEND": ns.attention_backend}
    results: dict[str, list[Summary]] = {"grpc": [], "openai": []}
    with Suite(SuiteConfig(model_dir=model, scheduler_port=0, with_offload=False, gateway_port=0,
                           extra_env=env)) as suite:
        base_url = f"http://{suite.services['gateway'].address}"
        for i in range(ns.repeats):
            order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
            for j, backend in enumerate(order):
                seed = 2 * i + j
                workload = WorkloadOptions(dataset="random", num_prompts=ns.num_prompts, input_len=ns.input_len,
                                           output_len=ns.output_len, seed=seed)
                opts = ServeOptions(address=suite.address, workload=workload, backend=backend, base_url=base_url,
                                    driver=DriverConfig(request_rate=math.inf, max_concurrency=ns.max_concurrency,
                                                        seed=seed, progress=False))
                with contextlib.redirect_stdout(io.StringIO()):
                    summary = run_serve(opts)
                if summary.failed:
                    raise SystemExit(f"{backend} run {i}: {summary.failed} requests failed")
                results[backend].append(summary)
                print(f"run {i} {backend}: {summary.output_throughput:.1f} tok/s, "
                      f"TTFT p50 {summary.ttft_ms.median:.1f} ms", file=sys.stderr, flush=True)
    print(f"| median of {ns.repeats} | gRPC | HTTP (OpenAI) | HTTP / gRPC |")
    print("|---|---|---|---|")
    for label, get, _higher_is_better in ROWS:
        g = statistics.median(get(s) for s in results["grpc"])
        h = statistics.median(get(s) for s in results["openai"])
        print(f"| {label} | {g:.1f} | {h:.1f} | {h / g:.2f} |" if g else f"| {label} | {g:.1f} | {h:.1f} | - |")
    print(f"\nmachine: {os.cpu_count()} CPUs; model {Path(model).name}; {ns.num_prompts} prompts x {ns.input_len} "
          f"tokens in, {ns.output_len} out, max concurrency {ns.max_concurrency}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
