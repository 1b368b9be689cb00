"""``kvmesh bench serve``: one serving benchmark against a running suite, from this (separate) process.

Asks the server its vocabulary and ``max_model_len``, builds the workload locally, checks every
request fits, sends one small warm-up request (a distinct prompt and salt, so it neither warms the
workload's prefixes nor counts), runs the driver, prints the report, and optionally saves the
JSON and the plot.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serve.datasets import WorkloadOptions, max_prompt_len
from bench.serve.driver import Driver, DriverConfig
from bench.serve.metrics import Summary, summarize
from bench.serve.report import format_summary, result_json
from bench.serve.transports import GrpcTransport, OpenAITransport, ServerInfo, Transport, WireRequest


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``kvmesh bench serve`` was asked to do."""

    address: str
    workload: WorkloadOptions
    driver: DriverConfig
    goodput: Mapping[str, float] = dataclasses.field(default_factory=dict)
    save_result: str = ""
    plot: str = ""
    warmup: bool = True
    backend: str = "grpc"  # or "openai": any OpenAI-compatible server at base_url
    base_url: str = ""
    model: str = ""
    api_key: str = ""
    vocab_size: int = 0


class WorkloadTooLong(ValueError):
    """A request of the workload would exceed the server's ``max_model_len``."""


def run_serve(opts: ServeOptions) -> Summary:
    """Runs the benchmark and prints the report on stdout; returns the summary."""
    transport, info, target = _connect(opts)
    try:
        convs = opts.workload.build(info.vocab_size)
        longest = max(max_prompt_len(c) + c.turns[-1].output_len for c in convs)
        if longest > info.max_model_len:
            raise WorkloadTooLong(
                f"the workload's longest request is {longest} tokens; the server's "
                f"max_model_len is {info.max_model_len}"
            )
        if opts.warmup:
            _warm_up(transport, info.vocab_size)
        rate = "inf" if math.isinf(opts.driver.request_rate) else f"{opts.driver.request_rate:g}"
        print(
            f"bench serve: {len(convs)} {opts.workload.dataset} prompts against {info.model_id} at "
            f"{target} ({opts.backend}), request rate {rate}, "
            f"max concurrency {opts.driver.max_concurrency or 'unlimited'}",
            file=sys.stderr,
            flush=True,
        )
        run = Driver(transport, opts.driver).run(convs)
    finally:
        transport.close()
    summary = summarize(run.records, run.duration, opts.goodput)
    print(format_summary(summary), flush=True)
    config = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": opts.backend,
        "address": target,
        "model_id": info.model_id,
        "workload": dataclasses.asdict(opts.workload),
        "driver": _driver_json(opts.driver),
        "goodput": dict(opts.goodput),
    }
    if opts.save_result:
        Path(opts.save_result).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.save_result).write_text(json.dumps(result_json(summary, run.records, config), indent=1))
        print(f"bench serve: results saved to {opts.save_result}", file=sys.stderr)
    if opts.plot:
        from bench.serve.plot import plot_run

        plot_run(run.records, summary, opts.plot, title=f"{opts.workload.dataset} workload, {info.model_id}")
        print(f"bench serve: plot saved to {opts.plot}", file=sys.stderr)
    return summary


def _driver_json(cfg: DriverConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    return out


def _connect(opts: ServeOptions) -> tuple[GrpcTransport | OpenAITransport, ServerInfo, str]:
    """The transport of ``opts.backend``, what the server serves, and where (for the report)."""
    if opts.backend == "openai":
        http = OpenAITransport(opts.base_url, opts.model, opts.api_key, opts.vocab_size)
        try:
            return http, http.info(), opts.base_url
        except BaseException:
            http.close()
            raise
    grpc_ = GrpcTransport(opts.address)
    m = grpc_.client.model_info()
    return grpc_, ServerInfo(m.model_id, m.vocab_size, m.max_model_len), opts.address


def _warm_up(transport: Transport, vocab_size: int) -> None:
    low = min(1000, vocab_size // 4)
    prompt = tuple(low + (i * 7919) % (vocab_size - low) for i in range(16))
    for _ in transport.stream(WireRequest(prompt, 2, cache_salt="kvmesh-bench-warmup")):
        pass
