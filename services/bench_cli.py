"""``kvmesh bench serve`` and ``kvmesh bench compare``: argument parsing only; the work is in ``bench/serve``.

    kvmesh bench serve --address HOST:PORT --dataset random --num-prompts 64 --request-rate inf
    kvmesh bench compare --num-prompts 16 --input-len 128 --output-len 64 --write-docs docs/benchmarks.md

``services.cli`` registers the group with :func:`add_bench_subcommand`. Everything heavy (the
benchmark package, torch, transformers, matplotlib) is imported when a subcommand runs, never when
the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.scheduler.config import DEFAULT_ADDRESS

FALLBACK_MODEL_DIR = "/tmp/kvmesh-cache/SmolLM2-135M-Instruct"
SYSTEMS = ("suite", "inprocess", "hf-static", "hf-cb")


def _bench(module: str) -> Any:
    """Imports ``bench.serve.<module>``.

    NOTE: ``bench/`` lives at the repository root and is not part of the installed packages, so a
    console script started elsewhere cannot see it; the repository root is added to ``sys.path``
    only when the plain import fails.
    """
    name = f"bench.serve.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        root = str(Path(__file__).resolve().parents[1])
        if root not in sys.path:
            sys.path.insert(0, root)
        return importlib.import_module(name)


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or inf: {text!r}") from None
    if rate <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return rate


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=("random", "prefix", "multi-turn"), default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts (conversations for multi-turn)")
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (random); unique suffix (prefix); new user tokens per turn (multi-turn)",
    )
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (exact: ignore_eos)")
    p.add_argument(
        "--length-dist",
        choices=("uniform", "lognormal"),
        default="uniform",
        help="uniform: [len*(1-r), len*(1+r)] with --random-range-ratio r; lognormal: ShareGPT-like tail",
    )
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="r of the uniform distribution, in [0, 1)")
    p.add_argument("--lognormal-sigma", type=float, default=0.5, help="shape of the lognormal distribution")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of each shared prefix (prefix dataset)")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (prefix dataset)")
    p.add_argument(
        "--unique-salts",
        action="store_true",
        help="a cache salt per request: no prefix sharing between requests (prefix caching 'off')",
    )
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (multi-turn dataset)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival process")


def _serve(ns: argparse.Namespace) -> int:
    datasets, driver, metrics, run = (_bench(m) for m in ("datasets", "driver", "metrics", "run"))
    workload = datasets.WorkloadOptions(
        dataset=ns.dataset,
        num_prompts=ns.num_prompts,
        input_len=ns.input_len,
        output_len=ns.output_len,
        length_dist=ns.length_dist,
        range_ratio=ns.random_range_ratio,
        sigma=ns.lognormal_sigma,
        prefix_len=ns.prefix_len,
        num_prefixes=ns.num_prefixes,
        turns=ns.turns,
        unique_salts=ns.unique_salts,
        seed=ns.seed,
    )
    opts = run.ServeOptions(
        backend=ns.backend,
        base_url=ns.base_url,
        model=ns.model,
        api_key=ns.api_key,
        vocab_size=ns.vocab_size,
        address=ns.address,
        workload=workload,
        driver=driver.DriverConfig(
            request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, seed=ns.seed, progress=not ns.no_progress
        ),
        goodput=metrics.parse_goodput(ns.goodput or []),
        save_result=ns.save_result,
        plot=ns.plot,
        warmup=not ns.no_warmup,
    )
    try:
        run.run_serve(opts)
    except run.WorkloadTooLong as exc:
        print(f"kvmesh bench serve: {exc}", file=sys.stderr)
        return 2
    return 0


def default_model_dir() -> str:
    """The prepared SmolLM2-135M-Instruct: the cache dir's copy if complete, else the machines' shared
    copy, else it is prepared now (tens of seconds, once)."""
    from services.model_runner.prepare import MARKER_NAME, MODEL_DIR_NAME, default_cache_dir, prepare_default_model

    cached = default_cache_dir() / MODEL_DIR_NAME
    if (cached / MARKER_NAME).exists():
        return str(cached)
    if (Path(FALLBACK_MODEL_DIR) / "config.json").exists():
        return FALLBACK_MODEL_DIR
    return str(prepare_default_model(default_cache_dir(), progress=True))


def _compare(ns: argparse.Namespace) -> int:
    compare, docs = _bench("compare"), _bench("docs")
    cfg = compare.CompareConfig(
        model_dir=str(Path(ns.model).resolve()) if ns.model else default_model_dir(),
        num_prompts=ns.num_prompts,
        input_len=ns.input_len,
        output_len=ns.output_len,
        repeats=ns.repeats,
        seed=ns.seed,
        systems=tuple(ns.systems),
        prefix_prompt_len=ns.prefix_prompt_len,
        prefix_share=ns.prefix_share,
        prefix_requests=ns.prefix_requests,
        run_prefix=not ns.no_prefix,
        kv_cache_memory_bytes=ns.kv_cache_memory_mib << 20,
        progress=not ns.no_progress,
        attention_backend=ns.attention_backend,
    )
    result = compare.run_compare(cfg)
    if ns.note:
        result.notes.extend(ns.note)
    print(docs.render(result))
    if ns.write_docs:
        print(f"bench compare: wrote {docs.write_docs(ns.write_docs, result)}", file=sys.stderr)
    if ns.save_result:
        Path(ns.save_result).write_text(json.dumps(dataclasses.asdict(result), indent=1, default=str))
    return 0


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """The ``bench compare`` options (shared with ``python bench/compare.py``)."""
    p.add_argument("--model", default="", help="checkpoint folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="repeats of every measurement (median, min-max)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--prefix-prompt-len", type=int, default=2048, help="prompt length of the prefix workload")
    p.add_argument("--prefix-share", type=float, default=0.9, help="shared share of each prefix-workload prompt")
    p.add_argument("--prefix-requests", type=int, default=4, help="measured requests per prefix run")
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching workload")
    p.add_argument("--kv-cache-memory-mib", type=int, default=512, help="KV pool of the kvmesh systems")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"],
                   help="the kvmesh systems' model-runner attention backend (cpu: the native kernels)")
    p.add_argument("--write-docs", default="", help="replace the generated section of this Markdown file")
    p.add_argument("--save-result", default="", help="write every figure as JSON")
    p.add_argument("--note", action="append", help="a line quoted under the generated tables (repeatable)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_compare)


def add_bench_subcommand(subparsers: Any) -> None:
    """Adds ``bench serve`` and ``bench compare`` to the ``kvmesh`` parser's subcommands."""
    bench = subparsers.add_parser("bench", help="serving benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="benchmark a running suite (gRPC) or any OpenAI-compatible server")
    serve.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                       help="grpc: kvmesh's Generate at --address; openai: POST /v1/completions at --base-url")
    serve.add_argument("--address", default=DEFAULT_ADDRESS, help="the scheduler (grpc backend)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the HTTP server (openai backend)")
    serve.add_argument("--model", default="", help="model name to send (openai backend; default: /v1/models' first)")
    serve.add_argument("--api-key", default="", help="sent as Authorization: Bearer (openai backend)")
    serve.add_argument("--vocab-size", type=int, default=0,
                       help="for servers whose /v1/models has no vocab_size (openai backend)")
    _add_workload_args(serve)
    serve.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson) or inf")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    serve.add_argument(
        "--ignore-eos",
        action="store_true",
        default=True,
        help="always on: every request generates exactly its output length",
    )
    serve.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    serve.add_argument("--save-result", default="",
                       help="write vLLM's flat JSON keys, kvmesh's KV section and every request")
    serve.add_argument("--plot", default="", help="write a PNG of latency percentiles and throughput over time")
    serve.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    serve.add_argument("--no-progress", action="store_true")
    serve.set_defaults(func=_serve)
    add_compare_args(sub.add_parser("compare", help="kvmesh vs transformers on the same prompts, in one run"))


def compare_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python bench/compare.py`` (the same options as ``kvmesh bench compare``)."""
    parser = argparse.ArgumentParser(prog="bench/compare.py", description="kvmesh vs transformers, in one run")
    add_compare_args(parser)
    ns = parser.parse_args(argv)
    result: int = ns.func(ns)
    return result
