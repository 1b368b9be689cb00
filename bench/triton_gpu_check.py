"""Self-check of the Triton attention kernels on a GPU: correctness against the torch references,
then kernel vs reference time. Not a test: a script to run once on a borrowed GPU.

Shapes are SmolLM2-135M's attention (9 query heads over 3 kv heads: a GQA ratio of 3, which the
kernel pads to a head group of 4; head_dim 64) with cache blocks of 16 tokens.

Usage::

    python bench/triton_gpu_check.py                 # CUDA, realistic shapes, with timings
    python bench/triton_gpu_check.py --tiny          # CPU, Triton interpreter, tiny shapes
    python bench/triton_gpu_check.py --compile-only  # no GPU needed: compile every launch for sm_90

Exit status: 0 all checks passed, 1 a mismatch or a failed launch, 2 nothing could run.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for `services`

FP8 = torch.float8_e4m3fn
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5  # softmax scale
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # atol == rtol
DTYPES = {  # name -> (query dtype, cache dtype)
    "fp32": (torch.float32, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16+fp8kv": (torch.bfloat16, FP8),
}


@dataclass(frozen=True)
class Case:
    """A batch: sequence i has ``query_lens[i]`` new tokens out of ``seq_lens[i]``."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


def cases(tiny: bool) -> list[Case]:
    if tiny:
        return [
            Case("decode4_ctx40", (1,) * 4, (40, 17, 33, 5)),
            Case("prefill48", (48,), (48,)),
            Case("mixed", (20, 1, 1), (52, 30, 9)),
        ]
    return [
        Case("decode32_ctx512", (1,) * 32, (512,) * 32),
        Case("decode32_ctx2048", (1,) * 32, (2048,) * 32),
        Case("prefill2048", (2048,), (2048,)),
        Case("chunk512+31dec", (512, *(1,) * 31), (1536, *range(700, 2250, 50))),
    ]


@dataclass
class Inputs:
    query: torch.Tensor  # [num_tokens, NUM_HEADS, HEAD_DIM]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    k_scale: float
    v_scale: float
    kv_bytes: int  # bytes of K/V the batch reads


def make_inputs(case: Case, dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> Inputs:
    """Random cache (blocks handed out in shuffled order) and queries; fp8 caches get scales."""
    gen = torch.Generator().manual_seed(0)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in case.seq_lens]
    num_blocks = sum(blocks) + 1  # + the null block 0
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(blocks):
        block_tables[s, :n] = ids[taken : taken + n]
        taken += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_scale = v_scale = 1.0
    if cache_dtype == FP8:
        k_scale, v_scale = 4.0 / 448, 4.0 / 448  # randn values beyond +-4 saturate, as in real use
        k, v = (k / k_scale).clamp(-448, 448), (v / v_scale).clamp(-448, 448)
    starts = [0, *torch.tensor(case.query_lens).cumsum(0).tolist()]
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, generator=gen)
    return Inputs(
        query=query.to(device, dtype),
        k_cache=k.to(device).to(cache_dtype),
        v_cache=v.to(device).to(cache_dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(case.query_lens),
        k_scale=k_scale,
        v_scale=v_scale,
        kv_bytes=2 * sum(case.seq_lens) * NUM_KV_HEADS * HEAD_DIM * torch.empty(0, dtype=cache_dtype).element_size(),
    )


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of ``fn``: triton's do_bench (flushes L2 between runs), else plain CUDA
    events; NaN on the CPU."""
    if device != "cuda":
        return float("nan")
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    except Exception as exc:  # NOTE: keep the check running if do_bench's API moved
        print(f"(do_bench failed: {exc!r}; timing with CUDA events)")
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check_attention(tiny: bool, device: str) -> bool:
    from services.model_runner.attention.kernels import paged_attention, paged_attention_ref

    ok = True
    print(f"{'paged_attention':<18}{'dtype':<12}{'max_err':>10}{'tol':>8}{'kernel_ms':>11}{'ref_ms':>9}"
          f"{'speedup':>9}{'kv_GB/s':>9}  result")  # fmt: skip
    for case in cases(tiny):
        for dname, (dtype, cache_dtype) in DTYPES.items():
            label = f"{case.name:<18}{dname:<12}"
            try:
                x = make_inputs(case, dtype, cache_dtype, device)
                meta = (x.query_start_loc, x.seq_lens, x.block_tables)
                kernel = partial(
                    paged_attention, x.query, x.k_cache, x.v_cache, *meta, x.max_query_len, SCALE, x.k_scale, x.v_scale
                )
                reference = partial(
                    paged_attention_ref, x.query, x.k_cache, x.v_cache, *meta, SCALE, x.k_scale, x.v_scale
                )
                out, expected = kernel().float(), reference().float()
                err = (out - expected).abs().max().item()
                tol = TOLERANCE[dtype]
                good = bool(torch.allclose(out, expected, atol=tol, rtol=tol)) and math.isfinite(err)
                k_ms, r_ms = time_ms(kernel, device), time_ms(reference, device)
                gbps = x.kv_bytes / (k_ms * 1e-3) / 1e9
                row = f"{label}{err:>10.2e}{tol:>8.0e}{k_ms:>11.3f}{r_ms:>9.3f}{r_ms / k_ms:>8.1f}x{gbps:>9.0f}"
                print(f"{row.replace('nan', '  -')}  {'ok' if good else 'MISMATCH'}")
                ok &= good
            except Exception:
                print(f"{label}FAILED:\n{traceback.format_exc()}")
                ok = False
    return ok


def check_write_kv(tiny: bool, device: str) -> bool:
    """Bitwise against the reference; an fp8 code one step off (a rounding tie decided
    differently) is tolerated in at most 0.1% of the values."""
    from services.model_runner.attention.kernels import write_kv, write_kv_ref

    ok = True
    num_tokens = 64 if tiny else 2048 + 32
    num_blocks = math.ceil(num_tokens / BLOCK_SIZE) * 2 + 1
    print(f"{'write_kv':<18}{'dtype':<12}{'mismatch':>10}{'kernel_ms':>19}{'ref_ms':>9}{'speedup':>9}  result")
    for dname, dtype, cache_dtype, scale in [
        ("fp16", torch.float16, torch.float16, 1.0),
        ("bf16", torch.bfloat16, torch.bfloat16, 1.0),
        ("bf16->fp8", torch.bfloat16, FP8, 0.01),
        ("fp32->fp8", torch.float32, FP8, 0.01),
    ]:
        label = f"{f'{num_tokens} tokens':<18}{dname:<12}"
        try:
            gen = torch.Generator().manual_seed(1)
            key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
            value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
            slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[:num_tokens] + BLOCK_SIZE
            slots[::7] = -1  # padding rows
            slots = slots.to(device)
            shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            caches = [torch.zeros(shape, device=device).to(cache_dtype) for _ in range(4)]
            write_kv(key, value, caches[0], caches[1], slots, scale, 2 * scale)
            write_kv_ref(key, value, caches[2], caches[3], slots, scale, 2 * scale)
            got = torch.stack(caches[:2]).view(torch.uint8 if cache_dtype == FP8 else torch.int16).int()
            want = torch.stack(caches[2:]).view(torch.uint8 if cache_dtype == FP8 else torch.int16).int()
            diff = (got - want).abs()
            mismatched = int((diff != 0).sum())
            one_step = int((diff == 1).sum())
            good = mismatched == 0 or (
                cache_dtype == FP8 and mismatched == one_step and one_step <= diff.numel() / 1000
            )
            args = (key, value, caches[0], caches[1], slots, scale, 2 * scale)
            ref_args = (key, value, caches[2], caches[3], slots, scale, 2 * scale)
            k_ms = time_ms(partial(write_kv, *args), device)
            r_ms = time_ms(partial(write_kv_ref, *ref_args), device)
            row = f"{label}{mismatched:>10}{k_ms:>19.3f}{r_ms:>9.3f}{r_ms / k_ms:>8.1f}x"
            print(f"{row.replace('nan', '  -')}  {'ok' if good else 'MISMATCH'}")
            ok &= good
        except Exception:
            print(f"{label}FAILED:\n{traceback.format_exc()}")
            ok = False
    return ok


# --- --compile-only: the GPU compiler's verdict without a GPU ------------------------------------

TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    FP8: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
}


def compile_only(cc: int) -> bool:
    """Runs the launchers on ``meta`` tensors with the kernels swapped for a recorder, then compiles
    each recorded launch for ``sm_<cc>`` (frontend, LLVM and ptxas: what the GPU would run).

    NOTE: uses triton's ``ASTSource``/``GPUTarget`` (internal, but stable across 3.x). Integer
    arguments equal to 1 become constants, as at a real launch; the real launch also marks
    16-divisible ones (alignment hints only).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # NOTE: import_module, as the package re-exports functions named like these modules.
    pa_mod = importlib.import_module("services.model_runner.attention.kernels.paged_attention")
    wk_mod = importlib.import_module("services.model_runner.attention.kernels.write_kv")

    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Recorder:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    for module, name in ((pa_mod, "_paged_attention_kernel"), (wk_mod, "_write_kv_kernel")):
        setattr(module, name, Recorder(getattr(module, name)))
    for case in cases(tiny=False):
        for dtype, cache_dtype in DTYPES.values():
            if cache_dtype == FP8 and cc < 89:
                continue
            x = make_inputs(case, dtype, cache_dtype, "meta")
            pa_mod.paged_attention(
                x.query, x.k_cache, x.v_cache, x.query_start_loc, x.seq_lens, x.block_tables,
                x.max_query_len, SCALE, x.k_scale, x.v_scale,
            )  # fmt: skip
            key = torch.empty(8, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="meta")
            wk_mod.write_kv(key, key, x.k_cache, x.v_cache, torch.empty(8, dtype=torch.long, device="meta"))

    ok, seen = True, set()
    print(f"compile-only for sm_{cc}: {len(launches)} launches")
    for fn, args, kwargs in launches:
        kwargs = dict(kwargs)
        num_warps = kwargs.pop("num_warps", 4)
        signature, constexprs = {}, {}
        for name, value in zip(fn.arg_names, [*args, *(kwargs[n] for n in fn.arg_names[len(args) :])], strict=True):
            if name in kwargs or (type(value) is int and value == 1):  # the runtime specialises 1s too
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + TRITON_TYPES[value.dtype]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        cache_key = (fn.__name__, tuple(signature.items()), tuple(constexprs.items()), num_warps)
        if cache_key in seen:
            continue
        seen.add(cache_key)
        data = "/".join(sorted({t[1:] for t in signature.values() if t.startswith("*") and t[1] != "i"}))
        label = f"{fn.__name__}[{data}] {' '.join(f'{k}={v}' for k, v in constexprs.items())} warps={num_warps}"
        try:
            start = time.perf_counter()
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps}
            )
            shared = compiled.metadata.shared
            print(f"  ok   {time.perf_counter() - start:5.1f}s shared={shared:>6}B  {label}")
        except Exception:
            print(f"  FAIL {label}\n{traceback.format_exc()}")
            ok = False
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    parser.add_argument("--compile-only", action="store_true", help="compile for a GPU without one")
    parser.add_argument("--cc", type=int, default=90, help="compute capability for --compile-only")
    args = parser.parse_args()

    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' @triton.jit run
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: use --tiny for the interpreter", file=sys.stderr)
        return 2
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    if args.compile_only:
        return 0 if compile_only(args.cc) else 1
    if args.tiny:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
        print(f"device {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
        if torch.cuda.get_device_capability() < (8, 9):
            print("note: fp8 (e4m3) needs sm_89+; the fp8 rows will fail on this GPU")
    else:
        print("no CUDA device: run with --tiny (interpreter) or --compile-only", file=sys.stderr)
        return 2
    print(f"heads {NUM_HEADS} / kv heads {NUM_KV_HEADS}, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}\n")

    start = time.perf_counter()
    ok = check_write_kv(args.tiny, device)
    print()
    ok &= check_attention(args.tiny, device)
    print(f"\n{'ALL OK' if ok else 'FAILURES'} in {time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
