"""Benchmark of the model-runner on SmolLM2-135M: decode step vs. its roofline, tokens/s vs. generate().

Everything runs in one process, one after the other, so the figures share the machine's state
(on a shared machine, compare the ratios rather than the absolute times):

1. The machine: copy bandwidth (a 1 GiB fp32 ``copy_``, bytes read + bytes written per second, the
   STREAM convention) and peak matmul FLOP/s (a 4096^2 fp32 ``torch.mm``).
2. The decode step: ``ModelRunner.execute`` with only decode requests, built by
   ``factory.build_runner``. For each context, ``max(--batches)`` requests of random tokens are
   prefilled (one request per step, not timed); then for each batch size the first ``B`` of them
   decode together, ``--repeats`` timed steps after two warm-up steps. The roofline of a step is
   ``max(bytes / bandwidth, flops / peak)`` with
   ``bytes = all weights + K/V of the batch at its context`` and
   ``flops = 2 * linear weights * B + 4 * B * context * layers * heads * head_dim`` (QK^T and PV);
   the arithmetic is ``bench/peerbench/roofline.py``'s (``bench/roofline.py`` adds bf16 and GEMM peaks).
3. Throughput: the same ``B`` prompts (real text, different lengths), greedy, ``--new-tokens``
   each, through the runner (one prefill step, then decode steps) and through transformers'
   ``generate()`` (static cache, batched, left padding, fp32, same threads), alternately for
   ``--throughput-repeats`` rounds; output tokens per second of wall time, prefill included for
   both (medians, and the median of the per-round ratios); and how many outputs agree token for
   token.

NOTE: blocks come from a shuffled free list, so block tables are as fragmented as a long-running
server's; nothing may rely on a sequence's blocks being adjacent in the pool.

Run: ``python bench/model_runner.py [--quick] [--threads 2]``; writes
``bench/results/model_runner.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.peerbench.roofline import DecoderShape, decode_step_cost  # noqa: E402
from bench.peerbench.roofline import roofline as step_roofline  # noqa: E402
from bench.peerbench.table import common_prefix  # noqa: E402
from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner  # noqa: E402
from services.model_runner.kv_pool import bytes_per_block  # noqa: E402
from services.model_runner.model.config import ModelConfig  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput  # noqa: E402

DEFAULT_MODEL = "/tmp/kvmesh-cache/SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a hash table works in two sentences.",
    "List three uses of copper.",
    "What is the boiling point of water at sea level, in Celsius and in Fahrenheit?",
    "Translate 'good morning' into Spanish.",
    "Once upon a time, in a small village at the foot of a mountain,",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Describe a cat to someone who has never seen one.",
    "How do vaccines train the immune system?",
    "My favourite book is",
    "In 1969, the first humans landed on the Moon. Tell me more about the mission.",
]


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup`` untimed ones; also every sample."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


def machine(repeats: int) -> dict[str, float]:
    """Copy and read bandwidth of a 1 GiB fp32 tensor (GB/s) and 4096^2 fp32 matmul GFLOP/s."""
    n = 1 << 28  # 1 GiB of fp32
    copy_s, read_s = _bandwidth_seconds(n, repeats)
    size = 4096
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    mm_s, _ = median_seconds(lambda: torch.mm(a, b, out=c), max(2, repeats // 2))
    return {
        "copy_gb_s": 2 * 4 * n / copy_s / 1e9,
        "read_gb_s": 4 * n / read_s / 1e9,
        "matmul_gflop_s": 2 * size**3 / mm_s / 1e9,
    }


def _bandwidth_seconds(n: int, repeats: int) -> tuple[float, float]:
    """Median seconds to copy, and to sum, ``n`` fp32 values (both buffers touched first: no page faults)."""
    src, dst = torch.ones(n), torch.zeros(n)
    copy_s, _ = median_seconds(lambda: dst.copy_(src), repeats)
    read_s, _ = median_seconds(lambda: src.sum(), repeats)
    return copy_s, read_s


@dataclass
class _Seq:
    """A request as this benchmark's tiny scheduler tracks it."""

    request_id: str
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent_blocks: int = 0
    output: list[int] = field(default_factory=list)


class Driver:
    """Just enough of a scheduler: a shuffled free list of blocks, prefill steps, decode steps."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.free = list(range(1, runner.pool.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.step_id = 0

    def _blocks_for(self, seq: _Seq, tokens: int) -> None:
        need = -(-tokens // BLOCK_SIZE) - len(seq.blocks)
        if need > len(self.free):
            raise RuntimeError("the benchmark's pool is too small")
        seq.blocks += [self.free.pop() for _ in range(need)]

    def _step(self, new: Sequence[NewRequestData] = (), cached: Sequence[CachedRequestData] = (),
              finished: Sequence[str] = ()) -> None:  # fmt: skip
        out = self.runner.execute(StepInput(self.step_id, tuple(new), tuple(cached), tuple(finished)))
        self.step_id += 1
        self._sampled = out.sampled

    def start(self, seqs: Sequence[_Seq]) -> None:
        """Prefills ``seqs`` in one step (each samples its first output token)."""
        new = []
        for seq in seqs:
            self._blocks_for(seq, len(seq.tokens))
            new.append(NewRequestData(seq.request_id, tuple(seq.tokens), len(seq.tokens), tuple(seq.blocks), 0,
                                      len(seq.tokens)))  # fmt: skip
            seq.sent_blocks, seq.computed = len(seq.blocks), len(seq.tokens)
        self._step(new=new)
        self._collect(seqs)

    def decode(self, seqs: Sequence[_Seq]) -> None:
        """One step in which every sequence of ``seqs`` computes its last sampled token."""
        cached = []
        for seq in seqs:
            self._blocks_for(seq, seq.computed + 1)
            cached.append(CachedRequestData(seq.request_id, tuple(seq.blocks[seq.sent_blocks :]), seq.computed, 1))
            seq.sent_blocks = len(seq.blocks)
            seq.computed += 1
        self._step(cached=cached)
        self._collect(seqs)

    def finish(self, seqs: Sequence[_Seq]) -> None:
        """Tells the runner the sequences are done and returns their blocks."""
        self._step(finished=[s.request_id for s in seqs])
        for seq in seqs:
            self.free += seq.blocks
            seq.blocks = []

    def _collect(self, seqs: Sequence[_Seq]) -> None:
        by_id = {s.request_id: s for s in seqs}
        for token in self._sampled:
            by_id[token.request_id].tokens.append(token.token_id)
            by_id[token.request_id].output.append(token.token_id)


def _build(args: argparse.Namespace, **fields: Any) -> ModelRunner:
    """``build_runner`` on the CPU with the benchmark's threads and block size (and quantization if set)."""
    if args.quantization != "none":
        fields["quantization"] = args.quantization
    fields.setdefault("attention_backend", args.attention_backend)
    return build_runner(RunnerConfig(model_dir=args.model, device="cpu", num_threads=args.threads,
                                     block_size=BLOCK_SIZE, **fields))  # fmt: skip


def roofline(cfg: ModelConfig, batch: int, context: float, machine_figs: dict[str, float]) -> dict[str, float]:
    """The lower bound of one fp32 decode step: reading weights + K/V, or the FLOPs, whichever is slower
    (the arithmetic is ``bench/peerbench/roofline.py``'s)."""
    shape = DecoderShape(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, cfg.vocab_size)
    cost = decode_step_cost(shape, batch, context, "float32", "float32")
    bound = step_roofline(cost, machine_figs["copy_gb_s"], machine_figs["matmul_gflop_s"])
    return {"bytes": cost.total_bytes, "flops": cost.flops, "memory_s": bound.memory_s, "compute_s": bound.compute_s,
            "bound_s": bound.bound_s}  # fmt: skip


def decode_steps(args: argparse.Namespace, machine_figs: dict[str, float]) -> list[dict[str, Any]]:
    """Median decode-step time per (context, batch), next to its roofline."""
    max_batch, max_ctx = max(args.batches), max(args.contexts)
    headroom = (2 + args.repeats) * len(args.batches) + 1  # tokens the first sequence decodes
    cfg = ModelConfig.from_dir(args.model)
    per_block = bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    blocks = max_batch * (-(-(max_ctx + headroom) // BLOCK_SIZE)) + 2
    runner = _build(args, kv_cache_memory_bytes=blocks * per_block, max_model_len=max_ctx + headroom)
    driver = Driver(runner)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for ctx in args.contexts:
            seqs = [_Seq(f"c{ctx}-{i}", torch.randint(3, cfg.vocab_size, (ctx,), generator=gen).tolist())
                    for i in range(max_batch)]  # fmt: skip
            start = time.perf_counter()
            for seq in seqs:
                driver.start([seq])
            prefill_s = time.perf_counter() - start
            print(f"  context {ctx}: prefilled {max_batch} x {ctx} tokens in {prefill_s:.1f} s", flush=True)
            for batch in args.batches:
                part = seqs[:batch]
                context = statistics.mean(s.computed + 1 for s in part)
                med, samples = median_seconds(partial(driver.decode, part), args.repeats, warmup=2)
                bound = roofline(cfg, batch, context, machine_figs)
                row = {"context": ctx, "mean_context": context, "batch": batch, "step_s": med,
                       "step_min_s": min(samples), "step_max_s": max(samples), "samples_s": samples,
                       "tokens_per_s": batch / med, **bound, "ratio": med / bound["bound_s"]}  # fmt: skip
                rows.append(row)
                print(f"  B={batch:3d} ctx={ctx:5d}: {med * 1e3:8.1f} ms (min {min(samples) * 1e3:.1f}, max "
                      f"{max(samples) * 1e3:.1f}); roofline {bound['bound_s'] * 1e3:.1f} ms -> x{row['ratio']:.2f}",
                      flush=True)  # fmt: skip
            driver.finish(seqs)
    finally:
        runner.pool.close()
    return rows


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Output tokens/s of the runner's decode loop and of ``generate()``, same prompts, greedy.

    NOTE: ``--throughput-repeats`` rounds, each running the runner then ``generate()``, so that a
    burst of load from another process hits both sides about equally; the speed-up reported is the
    median of the per-round ratios (and each side's median tok/s is given too).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch, new_tokens = max(args.batches), args.new_tokens
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (take {i // len(PROMPTS) + 1})")
             for i in range(batch)]  # fmt: skip
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    cfg = ModelConfig.from_dir(args.model)
    per_block = bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    longest = max(len(p) for p in prompts) + new_tokens
    runner = _build(args, kv_cache_memory_bytes=(batch * -(-longest // BLOCK_SIZE) + 2) * per_block)
    model = None
    if not args.skip_generate:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # exactly new_tokens each, like the runner's loop
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = {"do_sample": False, "cache_implementation": "static", "pad_token_id": tokenizer.pad_token_id,
              "top_p": None, "top_k": None, "temperature": None}  # fmt: skip
    rounds: list[dict[str, float]] = []
    ours: list[list[int]] = []
    theirs: list[list[int]] = []
    try:
        if model is not None:
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=2, **kwargs)  # warm-up (allocations, first-call paths)
        for i in range(args.throughput_repeats):
            driver = Driver(runner, seed=i)
            seqs = [_Seq(f"p{i}-{j}", list(p)) for j, p in enumerate(prompts)]
            start = time.perf_counter()
            driver.start(seqs)
            prefill_s = time.perf_counter() - start
            for _ in range(new_tokens - 1):
                driver.decode(seqs)
            runner_s = time.perf_counter() - start
            driver.finish(seqs)
            ours = [s.output for s in seqs]
            row = {
                "runner_s": runner_s,
                "runner_prefill_s": prefill_s,
                "runner_tokens_per_s": batch * new_tokens / runner_s,
            }
            if model is not None:
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = model.generate(**enc, max_new_tokens=new_tokens, **kwargs)
                    row["generate_s"] = time.perf_counter() - start
                theirs = out[:, enc["input_ids"].shape[1] :].tolist()
                row["generate_tokens_per_s"] = batch * new_tokens / row["generate_s"]
                row["speedup"] = row["runner_tokens_per_s"] / row["generate_tokens_per_s"]
            rounds.append(row)
            print("  round", i + 1, {k: round(v, 2) for k, v in row.items()}, flush=True)
    finally:
        runner.pool.close()
    runner_tps = statistics.median(r["runner_tokens_per_s"] for r in rounds)
    result: dict[str, Any] = {"batch": batch, "new_tokens": new_tokens, "prompt_tokens": [len(p) for p in prompts],
                              "rounds": rounds, "runner": {"tokens_per_s": runner_tps}}  # fmt: skip
    if model is not None:
        result["generate"] = {"tokens_per_s": statistics.median(r["generate_tokens_per_s"] for r in rounds)}
        result["speedup"] = statistics.median(r["speedup"] for r in rounds)
        common = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
        result["agreement"] = {"identical": sum(c == new_tokens for c in common), "of": batch,
                               "mean_common_prefix": statistics.mean(common)}  # fmt: skip
    return result


def print_table(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"\nmachine: copy {m['copy_gb_s']:.1f} GB/s, read {m['read_gb_s']:.1f} GB/s, "
          f"matmul {m['matmul_gflop_s']:.1f} GFLOP/s, threads {report['threads']}")  # fmt: skip
    print(f"{'batch':>5} {'context':>7} {'step ms':>9} {'min..max ms':>17} {'roofline ms':>11} {'bound':>7} "
          f"{'x roofline':>10} {'tok/s':>8}")  # fmt: skip
    for r in report["decode"]:
        bound = "memory" if r["memory_s"] >= r["compute_s"] else "compute"
        print(f"{r['batch']:>5} {r['context']:>7} {r['step_s'] * 1e3:>9.1f} "
              f"{r['step_min_s'] * 1e3:>8.1f}..{r['step_max_s'] * 1e3:<8.1f} {r['bound_s'] * 1e3:>11.1f} "
              f"{bound:>7} {r['ratio']:>10.2f} {r['tokens_per_s']:>8.1f}")  # fmt: skip
    t = report.get("throughput")
    if t:
        line = (f"throughput, {t['batch']} prompts x {t['new_tokens']} new tokens: "
                f"runner {t['runner']['tokens_per_s']:.1f} tok/s")  # fmt: skip
        if "generate" in t:
            line += (f", generate() {t['generate']['tokens_per_s']:.1f} tok/s (medians of {len(t['rounds'])} rounds); "
                     f"runner / generate x{t['speedup']:.2f}; identical outputs "
                     f"{t['agreement']['identical']}/{t['agreement']['of']}")  # fmt: skip
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint folder (fp32 safetensors)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--contexts", default="512,2048", help="comma-separated context lengths")
    parser.add_argument("--repeats", type=int, default=8, help="timed decode steps per row")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt in the throughput run")
    parser.add_argument("--throughput-repeats", type=int, default=3, help="rounds of runner + generate()")
    parser.add_argument("--quantization", default="none", help="RunnerConfig.quantization (none or int8)")
    parser.add_argument("--attention-backend", default="auto", help="RunnerConfig.attention_backend (auto, torch, cpu)")
    parser.add_argument("--skip-generate", action="store_true", help="no transformers generate() comparison")
    parser.add_argument("--quick", action="store_true", help="context 512 only, 4 repeats, 32 new tokens, 1 round")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "model_runner.json"))
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if args.quick:
        args.contexts, args.repeats, args.new_tokens = [min(args.contexts)], min(args.repeats, 4), 32
        args.throughput_repeats = 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "argv": sys.argv[1:], "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }  # fmt: skip
    print(f"machine (threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f})...", flush=True)
    report["machine"] = machine(3 if args.quick else 5)
    print(f"  {report['machine']}", flush=True)
    print("decode steps...", flush=True)
    report["decode"] = decode_steps(args, report["machine"])
    print("throughput...", flush=True)
    report["throughput"] = throughput(args)
    report["loadavg_end"] = os.getloadavg()
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
