"""The bf16 GEMM's two kernels (AMX ``gemm_amx.c``, AVX512-BF16 ``gemm_bf16.c``) against torch's bf16
``F.linear`` (oneDNN), interleaved in one process, at SmolLM2-135M's decode and prefill shapes.

Why: the machine is shared; the three take turns call by call, so a neighbour's load hits all
alike. The AVX512 kernel is the build without AMX (``load_kernels(no_amx=True)``): a process runs
one bf16 kernel for every call, so the A/B needs two builds, not a switch. torch's bf16 GEMM is
the speed reference only (kvmesh cannot use it: its result for a row depends on the batch).
Reports the median GFLOP/s of ``--repeats`` rounds after a warm-up, per thread count: in thread CPU
time at 1 thread (the OpenMP region runs on the calling thread, so time slices lost to other
processes do not count), wall time at more. The weights of a shape repeat call after call, so
they come from L2 / L3 (a decode step streams them from L3 or memory: bench/roofline.py).

Run: ``python bench/gemm_bf16_amx.py [--threads 1 2] [--rows 1 8 32 64 512] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_runner import native  # noqa: E402
from services.model_runner.model.packed import PackedWeight  # noqa: E402

SHAPES = {"up 576x1536": (576, 1536), "gate_up 576x3072": (576, 3072), "down 1536x576": (1536, 576),
          "qkv 576x960": (576, 960), "swiglu 576x3072": (576, 3072)}  # name: (k, n)  # fmt: skip


def _calls(kernels: native.NativeKernels, name: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    packed = PackedWeight(w, None, "native_bf16", kernels)
    if not name.startswith("swiglu"):
        return lambda: packed(x)
    inter = w.shape[0] // 2
    out = torch.empty(x.shape[0], inter)
    fn, weight = kernels.linear_bf16_swiglu, packed.packed
    assert fn is not None and isinstance(weight, torch.Tensor)
    # NOTE: the closure holds `weight` itself, not only its address: the packed tensor must outlive the calls
    return lambda: fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), inter, None,
                      out.data_ptr(), inter)


def _torch_call(name: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    if not name.startswith("swiglu"):
        return lambda: torch.nn.functional.linear(xb, wb)
    inter = w.shape[0] // 2

    def call() -> None:
        gu = torch.nn.functional.linear(xb, wb)
        torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]

    return call


def _seconds(fn: Callable[[], object], clock: Callable[[], float], budget: float = 0.03) -> float:
    start, calls = clock(), 0
    while (elapsed := clock() - start) < budget or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    amx, avx = native.load_kernels(), native.load_kernels(no_amx=True)
    assert amx is not None and avx is not None and amx.linear_bf16 is not None
    print(f"AMX in use: {amx.linear_bf16_amx} (the other build: {avx.linear_bf16_amx})")
    print("threads  shape              rows   AMX  AVX512  torch  GFLOP/s (median)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for name, (k, n) in SHAPES.items():
            for m in args.rows:
                gen = torch.Generator().manual_seed(m)
                x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
                fns = [_calls(amx, name, x, w), _calls(avx, name, x, w), _torch_call(name, x, w)]
                for fn in fns:
                    _seconds(fn, clock, 0.01)
                times: list[list[float]] = [[], [], []]
                for _ in range(args.repeats):
                    for i, fn in enumerate(fns):
                        times[i].append(_seconds(fn, clock))
                flops = 2.0 * m * k * n
                rates = [flops / statistics.median(t) / 1e9 for t in times]
                print(f"{threads:7d}  {name:17s} {m:5d} " + " ".join(f"{r:6.0f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
