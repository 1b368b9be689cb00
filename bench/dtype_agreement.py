"""bf16 mode against fp32 on the native kernels: step times, agreement with fp32, batch invariance.

In one process, on SmolLM2-135M (the embedded model, ``kvmesh model prepare``), with runners
built by ``factory.build_runner`` exactly as the service builds them:

* ``fp32``: ``dtype=float32``, ``attention_backend=cpu`` (the exact native mode);
* ``bf16``: ``dtype=bfloat16``, ``attention_backend=cpu`` (bf16 mode: bf16 GEMMs with fp32
  accumulation, ``native/gemm_bf16.c``; needs AVX512-BF16), its KV pool in bf16 (the default);
* ``bf16-fp32kv`` (``--fp32-kv``): bf16 mode over an fp32 KV pool (``kv_cache_dtype=float32``,
  bf16 mode's pool before bf16 KV);
* ``torch-bf16`` (``--torch-bf16``): ``dtype=bfloat16``, ``attention_backend=torch``, what ``auto``
  picked on a bf16 CPU before bf16 mode existed (oneDNN's bf16 GEMMs);
* ``int8`` (``--int8``): ``quantization=int8_weight_only`` on the native kernels (int8 weights
  with a scale per output channel, widened to bf16 in registers, ``native/gemm_int8.c``);
* ``q4_1`` (``--q4-1``): ``quantization=q4_1`` (llama.cpp's Q4_1 projections and Q8_0 head,
  fp32 GEMMs over the dequantized weights, ``native/gemm_q4_1.c``).

``--no-bf16`` leaves bf16 mode out (a CPU without AVX512-BF16 has none).

1. **Step times**, same-process A/B: the runners take turns step by step (so a noisy neighbour
   hits all of them alike); medians of ``--repeats`` steps (min..max). Decode steps at batch 1
   and 32 with ``--context`` tokens of random prompt each, and a ``--prefill``-token prefill of
   one new request.
2. **Agreement with fp32**: ``--prompts`` fixed English prompts, ``--new-tokens`` greedy tokens
   each, all prompts in one batch: sequences identical to fp32's, mean common prefix, and the
   sampled (top-1) token's logprob error against fp32's over the positions before the first
   difference (same context on both sides, so the same token's logprob is compared).
3. **Batch invariance**: each runner's greedy outputs with every prompt alone against all in one
   batch: sequences identical, and logprobs bitwise.

Run: ``python bench/dtype_agreement.py [--torch-bf16] [--repeats 9]``; writes
``bench/results/dtype_agreement.json``. Figures and their reading: docs/model_runner.md, "bf16 mode".
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.peerbench.table import common_prefix  # noqa: E402
from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner, cpu_flags  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL = str(Path.home() / ".cache/kvmesh/SmolLM2-135M-Instruct")  # where kvmesh model prepare puts it
BLOCK_SIZE = 16
# mode -> (dtype, attention_backend, quantization, kv_cache_dtype)
MODES = {"fp32": ("float32", "cpu", "none", "auto"), "bf16": ("bfloat16", "cpu", "none", "auto"),
         "bf16-fp32kv": ("bfloat16", "cpu", "none", "float32"), "torch-bf16": ("bfloat16", "torch", "none", "auto"),
         "int8": ("float32", "cpu", "int8_weight_only", "auto"), "q4_1": ("float32", "cpu", "q4_1", "auto")}
PROMPTS = (
    "The capital of France is", "Water boils at a temperature of", "Photosynthesis is the process by which",
    "Once upon a time, in a small village,", "The three primary colors are", "To make a cup of tea, first",
    "The largest planet in the solar system is", "In computer science, a hash table is",
    "The French Revolution began in", "A healthy breakfast usually includes", "The theory of relativity states",
    "My favourite book is", "The quickest way to learn a language is", "Rain forms when",
    "The best advice I ever received was", "Python is a programming language that",
)  # fmt: skip


@dataclass
class Seq:
    """One request as the benchmark's driver tracks it."""

    request_id: str
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Driver:
    """Just enough of a scheduler: a shuffled free list of blocks, prefill steps, decode steps."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.free = list(range(1, runner.pool.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.step_id = 0

    def _blocks(self, seq: Seq, tokens: int) -> None:
        need = -(-tokens // BLOCK_SIZE) - len(seq.blocks)
        if need > len(self.free):
            raise RuntimeError("the benchmark's pool is too small")
        seq.blocks += [self.free.pop() for _ in range(need)]

    def _step(self, seqs: Sequence[Seq], new: Sequence[NewRequestData] = (),
              cached: Sequence[CachedRequestData] = ()) -> float:  # fmt: skip
        start = time.perf_counter()
        out = self.runner.execute(StepInput(self.step_id, tuple(new), tuple(cached)))
        elapsed = time.perf_counter() - start
        self.step_id += 1
        by_id = {s.request_id: s for s in seqs}
        for token in out.sampled:
            seq = by_id[token.request_id]
            seq.tokens.append(token.token_id)
            seq.output.append(token.token_id)
            seq.logprobs.append(token.logprobs.sampled.logprob if token.logprobs is not None else float("nan"))
        return elapsed

    def start(self, seqs: Sequence[Seq], sampling: SamplingParams) -> float:
        """Prefills ``seqs`` in one step; the step's seconds."""
        new = []
        for seq in seqs:
            self._blocks(seq, len(seq.tokens))
            new.append(NewRequestData(seq.request_id, tuple(seq.tokens), len(seq.tokens), tuple(seq.blocks), 0,
                                      len(seq.tokens), sampling))  # fmt: skip
            seq.sent, seq.computed = len(seq.blocks), len(seq.tokens)
        return self._step(seqs, new=new)

    def decode(self, seqs: Sequence[Seq]) -> float:
        """One step in which every sequence computes its last sampled token; the step's seconds."""
        cached = []
        for seq in seqs:
            self._blocks(seq, seq.computed + 1)
            cached.append(CachedRequestData(seq.request_id, tuple(seq.blocks[seq.sent :]), seq.computed, 1))
            seq.sent, seq.computed = len(seq.blocks), seq.computed + 1
        return self._step(seqs, cached=cached)

    def finish(self, seqs: Sequence[Seq]) -> None:
        self.runner.execute(StepInput(self.step_id, finished_request_ids=tuple(s.request_id for s in seqs)))
        self.step_id += 1
        for seq in seqs:
            self.free += seq.blocks
            seq.blocks = []


def build(args: argparse.Namespace, mode: str, max_len: int, blocks: int) -> ModelRunner:
    dtype, backend, quantization, kv = MODES[mode]
    per_block = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32 K/V (the largest)
    runner = build_runner(RunnerConfig(model_dir=args.model, device="cpu", dtype=dtype, attention_backend=backend,
                                       block_size=BLOCK_SIZE, kv_cache_memory_bytes=blocks * per_block,
                                       max_model_len=max_len, quantization=quantization,
                                       kv_cache_dtype=kv))  # fmt: skip
    info = runner.model_info()
    print(f"  {mode}: dtype {info.dtype}, KV {info.kv_cache_dtype}, backend {info.attention_backend} "
          f"({info.attention_backend_reason})", flush=True)
    return runner


def _spread(samples: list[float]) -> dict[str, Any]:
    return {"median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3,
            "max_ms": max(samples) * 1e3, "samples_ms": [s * 1e3 for s in samples]}  # fmt: skip


def step_times(args: argparse.Namespace, runners: dict[str, ModelRunner]) -> dict[str, Any]:
    """Decode steps at batch 1 and 32 and one prefill, the runners taking turns step by step."""
    vocab = next(iter(runners.values())).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.context,), generator=gen).tolist() for _ in range(32)]
    drivers = {m: Driver(r) for m, r in runners.items()}
    result: dict[str, Any] = {}
    greedy = SamplingParams()
    for batch in (1, 32):
        seqs = {m: [Seq(f"d{batch}-{i}", list(p)) for i, p in enumerate(prompts[:batch])] for m in runners}
        for m, d in drivers.items():
            for seq in seqs[m]:  # one prefill per request, untimed
                d.start([seq], greedy)
            for _ in range(2):  # warm-up
                d.decode(seqs[m])
        samples: dict[str, list[float]] = {m: [] for m in runners}
        for _ in range(args.repeats):
            for m, d in drivers.items():
                samples[m].append(d.decode(seqs[m]))
        for m, d in drivers.items():
            d.finish(seqs[m])
        result[f"decode_b{batch}"] = {m: _spread(s) for m, s in samples.items()}
        print(f"  decode batch {batch}, context {args.context}: " + ", ".join(
            f"{m} {statistics.median(s) * 1e3:.1f} ms" for m, s in samples.items()), flush=True)
    prompt = torch.randint(3, vocab, (args.prefill,), generator=gen).tolist()
    samples = {m: [] for m in runners}
    for r in range(args.prefill_repeats + 1):
        for m, d in drivers.items():
            seq = Seq(f"p{r}", list(prompt))
            t = d.start([seq], greedy)
            d.finish([seq])
            if r:  # the first round warms up
                samples[m].append(t)
    result[f"prefill_{args.prefill}"] = {m: _spread(s) for m, s in samples.items()}
    print(f"  prefill {args.prefill} tokens: " + ", ".join(
        f"{m} {statistics.median(s) * 1e3:.1f} ms" for m, s in samples.items()), flush=True)
    return result


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, batched: bool) -> list[Seq]:
    """Greedy outputs with the sampled tokens' logprobs, all prompts in one batch or each alone."""
    driver = Driver(runner, seed=1)
    params = SamplingParams(logprobs=1, ignore_eos=True)
    groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
    seqs = [Seq(f"g{i}", list(p)) for i, p in enumerate(prompts)]
    for group in groups:
        part = [seqs[i] for i in group]
        driver.start(part, params)
        for _ in range(new_tokens - 1):
            driver.decode(part)
        driver.finish(part)
    return seqs


def agreement(ref: list[Seq], other: list[Seq]) -> dict[str, Any]:
    """Sequences identical to ``ref``, mean common prefix, and the sampled token's logprob error
    over each sequence's common prefix (same context, same token on both sides)."""
    prefixes = [common_prefix(a.output, b.output) for a, b in zip(ref, other, strict=True)]
    errors = [abs(a.logprobs[i] - b.logprobs[i]) for a, b, n in zip(ref, other, prefixes, strict=True)
              for i in range(n)]  # fmt: skip
    return {"identical": sum(a.output == b.output for a, b in zip(ref, other, strict=True)), "of": len(ref),
            "tokens_agreeing": sum(prefixes), "tokens": sum(len(a.output) for a in ref),
            "mean_common_prefix": statistics.mean(prefixes), "logprob_max_err": max(errors, default=0.0),
            "logprob_mean_err": statistics.mean(errors) if errors else 0.0,
            "bitwise": sum(a.output == b.output and a.logprobs == b.logprobs for a, b in zip(ref, other, strict=True))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint folder (fp32 safetensors)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the timed prefill")
    parser.add_argument("--repeats", type=int, default=9, help="timed decode steps per batch size and runner")
    parser.add_argument("--prefill-repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16, help=f"agreement prompts (at most {len(PROMPTS)})")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--torch-bf16", action="store_true", help="add the torch path in bf16 (oneDNN's GEMMs)")
    parser.add_argument("--int8", action="store_true", help="add quantization=int8_weight_only")
    parser.add_argument("--q4-1", action="store_true", help="add quantization=q4_1")
    parser.add_argument("--no-bf16", action="store_true", help="leave bf16 mode out")
    parser.add_argument("--fp32-kv", action="store_true", help="add bf16 mode over an fp32 KV pool")
    parser.add_argument("--threads", type=int, default=0, help="torch (and native) threads; 0 = torch's default")
    parser.add_argument("--skip-times", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "dtype_agreement.json"))
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[: args.prompts]]
    modes = ["fp32", *([] if args.no_bf16 else ["bf16"]), *(["bf16-fp32kv"] if args.fp32_kv else []),
             *(["torch-bf16"] if args.torch_bf16 else []), *(["int8"] if args.int8 else []),
             *(["q4_1"] if args.q4_1 else [])]
    flags = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "avx512f", "avx2"})
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, flags {flags}")
    max_len = max(args.context, args.prefill) + 64
    blocks = 32 * -(-max_len // BLOCK_SIZE) + 8
    runners = {m: build(args, m, max_len, blocks) for m in modes}
    report: dict[str, Any] = {"flags": flags, "threads": torch.get_num_threads(), "args": vars(args)}
    try:
        if not args.skip_times:
            report["step_times"] = step_times(args, runners)
        outputs = {} if args.skip_agreement else {
            m: {b: greedy(r, prompts, args.new_tokens, b) for b in (True, False)} for m, r in runners.items()}
    finally:
        for r in runners.values():
            r.pool.close()
    if not outputs:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
        return 0
    ref = outputs["fp32"][True]
    report["agreement_with_fp32"] = {m: agreement(ref, outputs[m][True]) for m in modes if m != "fp32"}
    report["alone_vs_batched"] = {m: agreement(outputs[m][False], outputs[m][True]) for m in modes}
    for m, a in report["agreement_with_fp32"].items():
        print(f"{m} vs fp32: {a['identical']}/{a['of']} sequences identical, {a['tokens_agreeing']}/{a['tokens']} "
              f"tokens before the first difference (mean prefix {a['mean_common_prefix']:.1f}); top-1 logprob "
              f"error max {a['logprob_max_err']:.2e}, mean {a['logprob_mean_err']:.2e}")
    for m, a in report["alone_vs_batched"].items():
        print(f"{m}, alone vs batched: {a['identical']}/{a['of']} sequences identical, {a['bitwise']}/{a['of']} "
              f"bitwise (logprobs too), max logprob difference {a['logprob_max_err']:.2e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
