"""``python bench/roofline.py``: kvmesh's batch-32 decode step against this machine's roofline.

    python bench/roofline.py                       # 1 and 2 threads, default and fp32 modes, 128 + 128
    python bench/roofline.py --quick               # smaller buffers, 8 timed steps: a smoke run

Per thread count, in one process, one after the other:

1. Memory bandwidth: a ``copy_`` of a large fp32 tensor (bytes read + written, the STREAM
   convention) and a ``sum`` of it (bytes read), median of the repeats; the roofline takes the
   higher of the two (a decode step only reads weights and K/V).
2. GEMM peak per dtype: ``torch.mm`` on a large square, and every GEMM of one decode step at the
   workload's shapes (``DecoderShape.gemm_shapes``) through each kernel kvmesh has for that dtype:
   ``F.linear``, the oneDNN-packed fp32 linear, the native fp32 GEMM, the native bf16 GEMM (where
   built). Weights of one layer fit in cache when repeated, so these are compute rates. The peak
   of a dtype is the best rate measured for it.
3. The decode step: the model-runner (``build_runner``, in this process) in each mode (``auto``,
   kvmesh's default, and ``fp32`` = float32 + the native kernels, the exact mode) prefills
   ``--batch`` prompts of ``--input-len`` random tokens, then decodes them together; every decode
   step is timed (median, min - max). Its roofline (``bench/peerbench/roofline.py``) is taken at
   the mean context of the timed steps, in the weight and KV dtypes the runner reports.

Writes ``OUT.json`` and ``OUT.md`` (default ``bench/results/roofline``); ``bench/peers.py`` runs
this and puts the table in its report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.model_runner import BLOCK_SIZE, Driver, _Seq  # noqa: E402
from bench.peerbench.roofline import (  # noqa: E402
    DecoderShape,
    decode_step_cost,
    gemm_rate_gflop_s,
    roofline,
    table_lines,
)
from bench.peerbench.roofline import peak_dtype as roofline_peak_dtype  # noqa: E402
from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner  # noqa: E402
from services.model_runner.kv_pool import bytes_per_block  # noqa: E402
from services.model_runner.model.packed import PackedWeight, onednn_available  # noqa: E402
from services.model_runner.native import load_kernels  # noqa: E402

MODES = {"auto": {"dtype": "auto", "attention_backend": "auto", "quantization": "auto"},
         "fp32": {"dtype": "float32", "attention_backend": "cpu", "quantization": "none"}}  # dense fp32 weights
PREFILL_GROUP = 4  # prompts per prefill step (4 x 128 = the scheduler's 512-token default budget)


def _median_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """Copy (read + write) and read GB/s of an ``nbytes`` fp32 buffer (pages touched first)."""
    n = nbytes // 4
    src, dst = torch.ones(n), torch.zeros(n)
    copy_s = _median_s(lambda: dst.copy_(src), repeats)
    read_s = _median_s(lambda: src.sum(), repeats)
    return {"copy_gb_s": 2 * 4 * n / copy_s / 1e9, "read_gb_s": 4 * n / read_s / 1e9}


def _bf16_linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    wb = w.to(torch.bfloat16)
    return lambda x: F.linear(x, wb)


def _linear_kernels(dtype: str) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """kernel name -> (weight fp32 [n, k] -> a callable x -> x W^T) for ``dtype``'s kernels that run here."""
    kernels: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {}
    if dtype == "float32":
        kernels["torch F.linear"] = lambda w: (lambda x: F.linear(x, w))
        if onednn_available():
            kernels["oneDNN packed"] = lambda w: PackedWeight(w, None, "fp32")
        if load_kernels() is not None:
            kernels["native"] = lambda w: PackedWeight(w, None, "native")
    else:
        kernels["torch F.linear"] = _bf16_linear
        native = load_kernels()
        if native is not None and native.linear_bf16 is not None:
            kernels["native bf16"] = lambda w: PackedWeight(w, None, "native_bf16")
    return kernels


def gemm_rates(shape: DecoderShape, batch: int, square: int, repeats: int) -> dict[str, dict[str, float]]:
    """dtype -> kernel -> GFLOP/s: ``torch.mm`` on ``square``^3, and one decode step's GEMMs per kernel."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for dtype, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(square, square, generator=gen).to(tdt), torch.randn(square, square, generator=gen).to(tdt)
        rates = {f"torch.mm {square}^3": 2 * square**3 / _median_s(partial(torch.mm, a, b), repeats) / 1e9}
        shapes = shape.gemm_shapes(batch)
        for name, make in _linear_kernels(dtype).items():
            seconds = []
            for _, m, k, n in shapes:
                w = torch.randn(n, k, generator=gen) / k**0.5
                x = torch.randn(m, k, generator=gen).to(tdt if name == "torch F.linear" else torch.float32)
                fn = make(w)
                seconds.append(_median_s(partial(fn, x), repeats))
            rates[f"{name}, step shapes"] = gemm_rate_gflop_s(shapes, seconds)
        out[dtype] = rates
    return out


def decode_step_times(model_dir: str, mode: str, threads: int, batch: int, input_len: int, steps: int,
                      seed: int) -> dict[str, Any]:
    """Times ``steps`` decode steps of ``batch`` sequences after prefilling ``input_len`` tokens each."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shape = DecoderShape.from_hf_config(cfg)
    per_block = bytes_per_block(shape.num_layers, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, torch.float32)
    blocks = batch * -(-(input_len + steps + 4) // BLOCK_SIZE) + 2
    runner = build_runner(RunnerConfig(model_dir=model_dir, device="cpu", num_threads=threads, block_size=BLOCK_SIZE,
                                       kv_cache_memory_bytes=blocks * per_block, max_model_len=input_len + steps + 4,
                                       dtype=MODES[mode]["dtype"],
                                       attention_backend=MODES[mode]["attention_backend"],
                                       quantization=MODES[mode]["quantization"]))
    info = runner.model_info()
    gen = torch.Generator().manual_seed(seed)
    seqs = [_Seq(f"r{i}", torch.randint(1000, shape.vocab_size, (input_len,), generator=gen).tolist())
            for i in range(batch)]
    driver = Driver(runner)
    try:
        for i in range(0, batch, PREFILL_GROUP):
            driver.start(seqs[i:i + PREFILL_GROUP])
        driver.decode(seqs)  # NOTE: untimed: the first decode step pays one-off costs
        samples, contexts = [], []
        for _ in range(steps):
            contexts.append(statistics.fmean(s.computed + 1 for s in seqs))
            t0 = time.perf_counter()
            driver.decode(seqs)
            samples.append(time.perf_counter() - t0)
    finally:
        runner.pool.close()
    return {"mode": mode, "threads": threads, "weight_dtype": info.dtype, "kv_dtype": info.kv_cache_dtype,
            "backend": info.attention_backend, "dtype_reason": info.dtype_reason,
            "mean_context": statistics.fmean(contexts),
            "step_s": statistics.median(samples), "step_min_s": min(samples), "step_max_s": max(samples),
            "samples_s": samples}


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    """Every thread count: bandwidth, GEMM rates, each mode's decode steps and roofline."""
    cfg = json.loads((Path(ns.model) / "config.json").read_text())
    shape = DecoderShape.from_hf_config(cfg)
    threads = [int(t) for t in ns.threads.split(",")]
    steps = ns.steps or (8 if ns.quick else ns.output_len - 1)
    nbytes, square, repeats = ((256 << 20), 1024, 3) if ns.quick else ((1 << 30), 2048, ns.repeats)
    machine: dict[str, Any] = {}
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        bw = bandwidth(nbytes, repeats)
        rates = gemm_rates(shape, ns.batch, square, repeats)
        machine[str(t)] = {**bw, "gemm_gflop_s": rates}
        _say(f"{t} thread(s): copy {bw['copy_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s; GEMM "
             + "; ".join(f"{d}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) for d, r in rates.items()))
        for mode in ns.modes.split(","):
            step = decode_step_times(ns.model, mode, t, ns.batch, ns.input_len, steps, ns.seed)
            torch.set_num_threads(t)  # NOTE: the runner set it too; keep the measurement's own
            cost = decode_step_cost(shape, ns.batch, step["mean_context"], step["weight_dtype"], step["kv_dtype"])
            peak_dtype = roofline_peak_dtype(step["weight_dtype"])
            bw_best = max(bw["copy_gb_s"], bw["read_gb_s"])
            peak = max(rates[peak_dtype].values())
            roof = roofline(cost, bw_best, peak)
            row = {**step, "batch": ns.batch, "weight_bytes": cost.weight_bytes, "kv_bytes": cost.kv_bytes,
                   "flops": cost.flops, "bandwidth_gb_s": bw_best, "peak_gflop_s": peak, "peak_dtype": peak_dtype,
                   "memory_s": roof.memory_s, "compute_s": roof.compute_s, "roofline_s": roof.bound_s,
                   "limit": roof.limit, "ratio": step["step_s"] / roof.bound_s}
            rows.append(row)
            _say(f"{mode} ({step['weight_dtype']}, {step['backend']}), {t} thread(s): "
                 f"step {step['step_s'] * 1e3:.1f} ms, roofline {roof.bound_s * 1e3:.1f} ms ({roof.limit}) "
                 f"-> {row['ratio']:.2f}x")
    return {"model_dir": ns.model, "shape": vars(shape), "batch": ns.batch, "input_len": ns.input_len,
            "output_len": ns.output_len, "timed_steps": steps, "quick": ns.quick, "buffer_bytes": nbytes,
            "machine": machine, "rows": rows}


def render(result: dict[str, Any]) -> str:
    """The markdown: the roofline table, then the measured rates per thread count."""
    lines = [f"Batch {result['batch']} decode steps at {result['input_len']} + {result['output_len']} context, "
             f"{result['timed_steps']} timed steps per row (median, min - max), roofline at the rows' mean context.",
             "", *table_lines(result["rows"]), "", "| threads | copy GB/s | read GB/s | dtype | GEMM GFLOP/s |",
             "|---:|---:|---:|---|---|"]
    for t, m in result["machine"].items():
        for dtype, rates in m["gemm_gflop_s"].items():
            lines.append(f"| {t} | {m['copy_gb_s']:.1f} | {m['read_gb_s']:.1f} | {dtype} | "
                         + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " |")
    return "\n".join(lines)


def _say(message: str) -> None:
    print(f"bench roofline: {message}", file=sys.stderr, flush=True)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="bench/roofline.py", description="decode step vs the machine's roofline")
    p.add_argument("--model", default=os.environ.get("KVMESH_MODEL_DIR", ""),
                   help="HF folder (default: $KVMESH_MODEL_DIR, else the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--modes", default="auto,fp32", help=f"comma list from {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128, help="decode steps timed: output_len - 1")
    p.add_argument("--steps", type=int, default=0, help="timed decode steps (default: output_len - 1; --quick 8)")
    p.add_argument("--repeats", type=int, default=5, help="repeats of every bandwidth and GEMM figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="256 MiB buffers, 1024^3 mm, 3 repeats, 8 timed steps")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "roofline"), help="writes OUT.json and OUT.md")
    ns = p.parse_args(argv)
    unknown = set(ns.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {', '.join(sorted(unknown))}")
    if not ns.model:
        from services.model_runner.prepare import default_cache_dir, prepare_default_model

        ns.model = str(prepare_default_model(default_cache_dir()))
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Measures, prints the markdown, writes OUT.json and OUT.md."""
    ns = parse(argv)
    result = measure(ns)
    result["command"] = "python bench/roofline.py " + " ".join(sys.argv[1:] if argv is None else list(argv))
    text = render(result)
    print(text)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    _say(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
