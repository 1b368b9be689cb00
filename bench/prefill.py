"""Prefill on the native CPU path: the attention kernel A/B, and the per-token cost by chunk size.

In one process, on SmolLM2-135M (the embedded model), with runners built by
``factory.build_runner`` as the service builds them (``attention_backend=cpu``):

1. **A/B** of the prefill attention, fp32 and bf16 mode: ``native`` = ``prefill_attention.c``
   (what the backend runs now), ``sdpa`` = the same runner with its prefill chunks sent back to
   torch's SDPA over the gathered chunk (what it ran before). The four runners take turns step by
   step, one ``--sizes``-token prefill of a fresh request each (medians over ``--repeats``, the
   first round a warm-up), so a noisy neighbour hits all of them alike.
2. **Per-op profile** (``--profile``): the same prefills once more with wall-clock timers around
   each op of the per-layer path (the GEMMs, attention with its K/V gather, the fused norms,
   rotary, SwiGLU, the K/V writes, the embedding, the head); what no timer covers is Python and
   input preparation. torch.profiler does not see the native kernels (ctypes calls), hence timers.
3. **Chunk sweep** (``--sweep``): a ``--sweep-prompt``-token prompt prefilled in chunks of each
   ``--chunks`` size (each chunk one step after the cached rows before it, as the scheduler's token
   budget splits it), per-token cost = the prompt's total time / its tokens; and a decode step at
   batch 1 and 32 at the prompt's context, for the budget's trade-off (docs/model_runner.md,
   "Prefill").

Run: ``python bench/prefill.py [--threads 1] [--sweep]``; writes ``bench/results/prefill.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.dtype_agreement import BLOCK_SIZE, Driver, Seq  # noqa: E402
from services.model_runner.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL = str(Path.home() / ".cache/kvmesh/SmolLM2-135M-Instruct")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
QUANTIZATION = {"fp32": "none", "bf16": "auto"}


def build(model: str, dtype: str, max_len: int, sdpa: bool, blocks: int = 0) -> ModelRunner:
    """A runner on the native backend; ``sdpa``: its prefill chunks through torch's SDPA (the former path)."""
    per_block = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32 K/V
    blocks = max(blocks, 2 * (max_len // BLOCK_SIZE) + 80)
    # NOTE: fp32 with dense weights, as the peers' fp32 row (bench/peerbench/engines.py): `auto` would
    # keep an on-grid checkpoint's weights in Q4_1 (the embedded SmolLM2), another GEMM
    runner = build_runner(RunnerConfig(model_dir=model, device="cpu", dtype=DTYPES[dtype], attention_backend="cpu",
                                       block_size=BLOCK_SIZE, kv_cache_memory_bytes=blocks * per_block,
                                       max_model_len=max_len, quantization=QUANTIZATION[dtype]))  # fmt: skip
    backend = runner.backend
    assert isinstance(backend, CpuAttentionBackend)
    if sdpa:  # NOTE: bench-only switch: the chunks go where they went before prefill_attention.c
        def former(kernels, plan, query, k_cache, v_cache, out, scale, k_scale, v_scale):  # type: ignore[no-untyped-def]
            backend._attend_chunks(query, k_cache, v_cache, plan.chunks, out, scale, k_scale, v_scale)

        backend._attend_prefill = former  # type: ignore[method-assign]
    return runner


def _spread(samples: list[float]) -> dict[str, Any]:
    return {"median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3,
            "max_ms": max(samples) * 1e3, "samples_ms": [s * 1e3 for s in samples]}  # fmt: skip


def ab(args: argparse.Namespace) -> dict[str, Any]:
    names = [f"{d}-{a}" for d in DTYPES for a in ("sdpa", "native")]
    runners = {n: build(args.model, n.split("-")[0], max(args.sizes) + 64, n.endswith("sdpa")) for n in names}
    drivers = {n: Driver(r) for n, r in runners.items()}
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {}
    for size in args.sizes:
        prompt = torch.randint(3, 49_000, (size,), generator=gen).tolist()
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats + 1):
            for n, d in drivers.items():
                seq = Seq(f"p{size}-{r}", list(prompt))
                t = d.start([seq], SamplingParams())
                d.finish([seq])
                if r:
                    samples[n].append(t)
        result[f"prefill_{size}"] = {n: _spread(s) for n, s in samples.items()}
        print(f"  prefill {size}: " + ", ".join(f"{n} {statistics.median(s) * 1e3:.0f} ms" for n, s in samples.items()),
              flush=True)  # fmt: skip
    return result


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Per-op milliseconds of one prefill step per runner and size (medians of ``--repeats``)."""
    from services.model_runner.model import layers, native_layers, packed
    from services.model_runner.model.transformer import CausalLM

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(cls: Any, name: str, label: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(cls, name, wrapper)

    ops: tuple[tuple[Any, str, str], ...] = (
        (packed.PackedWeight, "__call__", "gemm"), (CpuAttentionBackend, "forward", "attention"),
        (CpuAttentionBackend, "write_kv", "kv_write"), (native_layers.NativeRMSNorm, "forward", "norm"),
        (native_layers.NativeRMSNorm, "add_forward", "norm"), (native_layers.NativeRotary, "forward", "rotary"),
        (native_layers.NativeSiluAndMul, "forward", "swiglu"), (layers.Embedding, "forward", "embed"),
        (CausalLM, "compute_logits", "head"),
    )  # fmt: skip
    for cls, name, label in ops:
        timed(cls, name, label)
    result: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(2)
    for size in args.sizes:
        prompt = torch.randint(3, 49_000, (size,), generator=gen).tolist()
        for name in (f"{d}-{a}" for d in DTYPES for a in ("sdpa", "native")):
            d = Driver(build(args.model, name.split("-")[0], size + 64, name.endswith("sdpa")))
            rows: dict[str, list[float]] = collections.defaultdict(list)
            for r in range(args.repeats + 1):
                spent.clear()
                seq = Seq(f"f{r}", list(prompt))
                step = d.start([seq], SamplingParams())
                d.finish([seq])
                if r:
                    rows["step"].append(step)
                    for label, t in spent.items():
                        rows[label].append(t)
                    rows["rest"].append(step - sum(spent.values()))
            ms = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
            result[f"{name}_{size}"] = ms
            print(f"  profile {name} {size}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()), flush=True)
    return result


def chunked_prefill(d: Driver, seq: Seq, chunk: int) -> float:
    """Prefills ``seq`` in ``chunk``-token steps (the first step new, the rest cached); total seconds."""
    total, n = 0.0, len(seq.tokens)
    while seq.computed < n:
        take = min(chunk, n - seq.computed)
        d._blocks(seq, seq.computed + take)
        if seq.computed == 0:
            step = StepInput(d.step_id, (NewRequestData(seq.request_id, tuple(seq.tokens), n, tuple(seq.blocks), 0,
                                                        take, SamplingParams()),), ())  # fmt: skip
        else:
            step = StepInput(d.step_id, (), (CachedRequestData(seq.request_id, tuple(seq.blocks[seq.sent :]),
                                                               seq.computed, take),))  # fmt: skip
        seq.sent, seq.computed = len(seq.blocks), seq.computed + take
        start = time.perf_counter()
        d.runner.execute(step)
        total += time.perf_counter() - start
        d.step_id += 1
    return total


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 49_000, (args.sweep_prompt,), generator=gen).tolist()
    for dtype in args.sweep_dtypes:
        blocks = 32 * (args.decode_context // BLOCK_SIZE + 2) + 2 * (args.sweep_prompt // BLOCK_SIZE) + 80
        runner = build(args.model, dtype, args.sweep_prompt + 64, sdpa=False, blocks=blocks)
        d = Driver(runner)
        per: dict[str, Any] = {}
        for r in range(args.repeats + 1):
            for chunk in args.chunks:
                seq = Seq(f"s{chunk}-{r}", list(prompt))
                t = chunked_prefill(d, seq, chunk)
                d.finish([seq])
                if r:
                    per.setdefault(str(chunk), []).append(t / len(prompt))
        result[dtype] = {"per_token": {c: _spread(s) for c, s in per.items()}}
        print(f"  {dtype} per-token prefill of {args.sweep_prompt}: " + ", ".join(
            f"chunk {c} {statistics.median(s) * 1e3:.3f} ms" for c, s in per.items()), flush=True)
        for batch in (1, 32):
            seqs = [Seq(f"d{batch}-{i}", list(prompt[: args.decode_context])) for i in range(batch)]
            for seq in seqs:
                chunked_prefill(d, seq, 512)
            times = [d.decode(seqs) for _ in range(args.repeats + 2)][2:]
            d.finish(seqs)
            result[dtype][f"decode_b{batch}"] = _spread(times)
            print(f"  {dtype} decode batch {batch} at context {args.decode_context}: "
                  f"{statistics.median(times) * 1e3:.1f} ms", flush=True)  # fmt: skip
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-ab", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-prompt", type=int, default=2048)
    parser.add_argument("--sweep-dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/prefill.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                           "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if not args.skip_ab:
        out["ab"] = ab(args)
    if args.profile:
        out["profile"] = profile(args)
    if args.sweep:
        out["sweep"] = sweep(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
