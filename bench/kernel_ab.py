"""A/B of the native prefill kernels: another commit's build against this checkout's, in one process.

Why: the machine is shared, and a prefill benchmark's wall time moves by 2x with the neighbours'
load. Here both builds run in the same process, taking turns call by call, timed in **thread CPU
time** (one compute thread: the OpenMP region runs on the calling thread), so time slices lost to
other processes do not count; what the neighbours still cost (shared caches, memory bandwidth)
hits both builds alike. Medians of ``--repeats`` after one warm-up round; the outputs of the two
builds are compared bitwise (a kernel change that keeps the arithmetic must keep the bits).

What: the four SmolLM2-135M linear layers at ``--rows`` rows (bf16 ``gemm_bf16.c``, fp32
``gemm.c``), and ``prefill_attention.c`` on the two 512-token chunks of a 1,024-token prompt (9
query heads, 3 KV heads, head_dim 64: context 512 and 1,024), full and with a ``WINDOW``-key sliding
window; with ``--parts bf16-attention`` both attention kernels over a bf16 pool (bf16 mode's
default); plus the machine's ``vdpbf16ps`` and fp32 FMA peak (a register-only loop, the same
thread) to read the GEMMs' GFLOP/s against.

With ``--step-rows``, also the fp32 GEMMs of a whole SmolLM2-135M step (30 layers' qkv, o,
gate_up and down, and the tied head) at each row count, on 121 distinct weights (538 MB), and bf16
mode's (the 30 layers, gate_up fused with SwiGLU as a prefill runs it; 208 MB): each pass streams
them from memory, as a real step does (the per-layer rows above reuse one weight from cache).

Run: ``python bench/kernel_ab.py --base bb72a9b [--repeats 9] [--rows 512] [--step-rows 32 64 512]``;
``--parts decode-attention [--contexts 192 512] [--in-cache]`` for the decode kernel;
``--parts q4_1 [--step-rows 1]`` for the grouped (Q4_1 / Q8_0) GEMMs of a single-stream step.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_runner import native  # noqa: E402
from services.model_runner.factory import cpu_flags  # noqa: E402
from services.model_runner.model.packed import (  # noqa: E402
    pack_panels,
    pack_panels_bf16,
    pack_q_groups,
    quantize_q4_1,
    quantize_q8_0,
)

NATIVE = "services/model_runner/native"
WINDOW = 256  # a sliding window (keys) for the windowed attention cases
LAYERS = {"qkv": (576, 832), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)
# A whole step's weights: SmolLM2-135M's 30 layers (qkv: 9 query + 2 x 3 KV heads of 64), then the tied head; (in, out)
STEP_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]
# The peaks on a CPU without AVX-512: the fp32 FMA rate in 8 lanes (no bf16 dot products there).
PEAK_AVX2_C = r"""
#include <immintrin.h>
#define R(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define D(i) __m256 c##i = _mm256_set1_ps(i * 1e-3f);
#define S(i) { float t[8]; _mm256_storeu_ps(t, c##i); for (int j = 0; j < 8; j++) s += t[j]; }
float peak_f32(long n) {
    R(D) const __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
#define F(i) c##i = _mm256_fmadd_ps(a, c##i, b);
    for (long i = 0; i < n; i++) { R(F) }
    float s = 0; R(S) return s;
}
"""
PEAK_C = r"""
#include <immintrin.h>
#define R(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define D(i) __m512 c##i = _mm512_set1_ps(i * 1e-3f);
#define S(i) s += _mm512_reduce_add_ps(c##i);
float peak_bf16(long n) {
    R(D) const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
#define B(i) c##i = _mm512_dpbf16_ps(c##i, a, a);
    for (long i = 0; i < n; i++) { R(B) }
    float s = 0; R(S) return s;
}
float peak_f32(long n) {
    R(D) const __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
#define F(i) c##i = _mm512_fmadd_ps(a, c##i, b);
    for (long i = 0; i < n; i++) { R(F) }
    float s = 0; R(S) return s;
}
"""
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _compile(sources: Sequence[Path], out: Path) -> ctypes.CDLL:
    # NOTE: the prefetch target as the loader picks it here (a macro the base does not know is ignored)
    flags = [f for f in (*native.CFLAGS, *native.kv_prefetch_cflags()) if f != "-Wall"]
    subprocess.run(["cc", *flags, "-o", str(out), *map(str, sources), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.kvmesh_linear_bf16.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I]
    lib.kvmesh_linear_f32.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I]
    lib.kvmesh_linear_q4_1.argtypes = lib.kvmesh_linear_q8_0.argtypes = lib.kvmesh_linear_f32.argtypes
    lib.kvmesh_linear_bf16_swiglu.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I]
    lib.kvmesh_prefill_attention_f32.argtypes = [_P, _I, _P, _P, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I,
                                                 ctypes.c_float, _I]  # fmt: skip
    lib.kvmesh_prefill_attention_bf16.argtypes = lib.kvmesh_prefill_attention_f32.argtypes
    lib.kvmesh_paged_decode_bf16.argtypes = [_P, _I, _P, _P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I,
                                             ctypes.c_float, _I]  # fmt: skip
    lib.kvmesh_paged_decode_f32.argtypes = lib.kvmesh_paged_decode_bf16.argtypes
    return lib


def builds(base: str, work: Path) -> dict[str, ctypes.CDLL]:
    """``{"base": base's kernels, "new": this checkout's}``, compiled into ``work``."""
    tree = work / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", base, NATIVE], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return {"base": _compile(sorted((tree / NATIVE).glob("*.c")), work / "base.so"),
            "new": _compile(native.SOURCES, work / "new.so")}  # fmt: skip


Call = tuple[Callable[..., object], tuple[object, ...]]


def race(calls: dict[str, Call], repeats: int) -> dict[str, float]:
    """Median thread CPU seconds of each ``fn(*args)``, the calls taking turns; the first round is a
    warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats + 1):
        for name, (fn, args) in calls.items():
            start = time.thread_time()
            fn(*args)
            if r:
                samples[name].append(time.thread_time() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _bf16_built(libs: dict[str, ctypes.CDLL]) -> bool:
    """Whether both builds have the bf16 GEMM (AVX512-BF16); elsewhere the bf16 figures are skipped."""
    return all(lib.kvmesh_linear_bf16_available() for lib in libs.values())


def gemms(libs: dict[str, ctypes.CDLL], rows: int, repeats: int) -> None:
    kinds = (("kvmesh_linear_bf16", pack_panels_bf16),) if _bf16_built(libs) else ()
    for fn, pack in (*kinds, ("kvmesh_linear_f32", pack_panels)):
        total = dict.fromkeys(libs, 0.0)
        for layer, (k, n) in LAYERS.items():
            gen = torch.Generator().manual_seed(k + n)
            x, weight = torch.randn(rows, k, generator=gen), pack(torch.randn(n, k, generator=gen) * 0.05, 48)
            outs = {name: torch.empty(rows, n) for name in libs}
            med = race({name: (getattr(lib, fn), (x.data_ptr(), k, rows, k, weight.data_ptr(), n, None,
                                                  outs[name].data_ptr(), n)) for name, lib in libs.items()}, repeats)
            for name in libs:
                total[name] += med[name]
            gf = {name: 2 * rows * k * n / t / 1e9 for name, t in med.items()}
            print(f"{fn} {layer} [{rows} x {k}] x [{k} x {n}]: base {med['base'] * 1e3:.2f} ms "
                  f"({gf['base']:.0f} GFLOP/s), new {med['new'] * 1e3:.2f} ms ({gf['new']:.0f}), "
                  f"new/base {med['new'] / med['base']:.3f}, bitwise {torch.equal(outs['base'], outs['new'])}")
        print(f"{fn} one layer's four GEMMs: new/base {total['new'] / total['base']:.3f}")


def step_gemms(libs: dict[str, ctypes.CDLL], rows: Sequence[int], repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [(pack_panels(torch.randn(n, k, generator=gen) * 0.05, 48), k, n) for k, n in STEP_SHAPES]
    for m in rows:
        x = torch.randn(m, 1536, generator=gen)
        outs = {name: [torch.empty(m, n) for _, _, n in weights] for name in libs}

        def step(lib: ctypes.CDLL, outs: list[torch.Tensor], m: int = m, x: torch.Tensor = x) -> None:
            for (w, k, n), out in zip(weights, outs, strict=True):
                lib.kvmesh_linear_f32(x.data_ptr(), x.stride(0), m, k, w.data_ptr(), n, None, out.data_ptr(), n)

        med = race({name: (step, (lib, outs[name])) for name, lib in libs.items()}, repeats)
        flops = sum(2 * m * k * n for _, k, n in weights)
        bitwise = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"], strict=True))
        base, new = med["base"], med["new"]
        print(f"fp32 step GEMMs, {m} rows, {len(weights)} weights streamed: base {base * 1e3:.1f} ms "
              f"({flops / base / 1e9:.0f} GFLOP/s), new {new * 1e3:.1f} ms ({flops / new / 1e9:.0f}), "
              f"new/base {new / base:.3f}, bitwise {bitwise}")  # fmt: skip


def step_gemms_bf16(libs: dict[str, ctypes.CDLL], rows: Sequence[int], repeats: int) -> None:
    """bf16 mode's GEMMs of a whole SmolLM2-135M prefill step (30 layers: qkv, o, the fused gate_up +
    SwiGLU, down; 104M weights, 208 MB of bf16 panels) at each row count, each pass streaming the
    weights from memory as a real step does."""
    if not _bf16_built(libs):
        return
    shapes = [(576, 960, "linear"), (576, 576, "linear"), (576, 3072, "swiglu"), (1536, 576, "linear")] * 30
    gen = torch.Generator().manual_seed(0)
    weights = [(pack_panels_bf16(torch.randn(n, k, generator=gen) * 0.05, 48), k, n, kind) for k, n, kind in shapes]
    for m in rows:
        x = torch.randn(m, 1536, generator=gen)
        # the fused SwiGLU writes [m, n / 2]
        outs = {name: [torch.empty(m, n // 2 if kind == "swiglu" else n) for _, _, n, kind in weights]
                for name in libs}  # fmt: skip

        def step(lib: ctypes.CDLL, outs: list[torch.Tensor], m: int = m, x: torch.Tensor = x) -> None:
            for (w, k, n, kind), out in zip(weights, outs, strict=True):
                if kind == "swiglu":
                    lib.kvmesh_linear_bf16_swiglu(x.data_ptr(), x.stride(0), m, k, w.data_ptr(), n // 2, None,
                                                  out.data_ptr(), n // 2)  # fmt: skip
                else:
                    lib.kvmesh_linear_bf16(x.data_ptr(), x.stride(0), m, k, w.data_ptr(), n, None, out.data_ptr(), n)

        med = race({name: (step, (lib, outs[name])) for name, lib in libs.items()}, repeats)
        flops = sum(2 * m * k * n for _, k, n, _ in weights)
        bitwise = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"], strict=True))
        base, new = med["base"], med["new"]
        print(f"bf16 step GEMMs, {m} rows, {len(weights)} weights streamed: base {base * 1e3:.1f} ms "
              f"({flops / base / 1e9:.0f} GFLOP/s), new {new * 1e3:.1f} ms ({flops / new / 1e9:.0f}), "
              f"new/base {new / base:.3f}, bitwise {bitwise}")  # fmt: skip


def step_gemms_q4_1(libs: dict[str, ctypes.CDLL], rows: Sequence[int], repeats: int) -> None:
    """The grouped GEMMs of a whole SmolLM2-135M step under ``quantization=q4_1`` (what ``auto``
    runs on the embedded checkpoint without bf16 hardware): 30 layers' qkv, o, gate_up and down in
    Q4_1, the tied head in Q8_0, at each row count (1: a single stream's decode step). Once with
    the 121 weights streamed from memory (106M + 28M weights, 115 MB), once with the first
    layer's four weights repeated (3 MB, from L3) and the head left out: the kernel's own rate."""
    gen = torch.Generator().manual_seed(0)

    def packed(k: int, n: int, entry: str) -> tuple[torch.Tensor, int, int, str]:
        weight = torch.randn(n, k, generator=gen) * 0.05
        bits, quantize = (4, quantize_q4_1) if entry == "kvmesh_linear_q4_1" else (8, quantize_q8_0)
        return pack_q_groups(*quantize(weight, 32), bits=bits, width=48, group=32), k, n, entry

    head = len(STEP_SHAPES) - 1
    weights = [packed(k, n, "kvmesh_linear_q8_0" if i == head else "kvmesh_linear_q4_1")
               for i, (k, n) in enumerate(STEP_SHAPES)]
    cases = {"streamed": weights, "in cache": weights[:4] * 30}
    for m in rows:
        x = torch.randn(m, 1536, generator=gen)
        for case, ws in cases.items():
            outs = {name: [torch.empty(m, n) for _, _, n, _ in ws] for name in libs}

            def step(lib: ctypes.CDLL, outs: list[torch.Tensor], m: int = m, x: torch.Tensor = x,
                     ws: list[tuple[torch.Tensor, int, int, str]] = ws) -> None:
                for (w, k, n, entry), out in zip(ws, outs, strict=True):
                    getattr(lib, entry)(x.data_ptr(), x.stride(0), m, k, w.data_ptr(), n, None, out.data_ptr(), n)

            med = race({name: (step, (lib, outs[name])) for name, lib in libs.items()}, repeats)
            count = sum(k * n for _, k, n, _ in ws)
            bitwise = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"], strict=True))
            base, new = med["base"], med["new"]
            print(f"q4_1 step GEMMs, {m} rows, {case}: base {base * 1e3:.2f} ms ({count / base / 1e9:.1f} G "
                  f"weights/s), new {new * 1e3:.2f} ms ({count / new / 1e9:.1f}), new/base {new / base:.3f}, "
                  f"bitwise {bitwise}")  # fmt: skip


def attention(libs: dict[str, ctypes.CDLL], repeats: int) -> None:
    heads, kv_heads, dim, block = 9, 3, 64, 16
    total = dict.fromkeys(libs, 0.0)
    for seq_len, num_q, window in ((512, 512, 0), (1024, 512, 0), (512, 512, WINDOW), (1024, 512, WINDOW)):
        gen = torch.Generator().manual_seed(seq_len)
        blocks = seq_len // block + 4
        k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen) for _ in range(2))
        table = torch.randperm(blocks, generator=gen)[: seq_len // block].to(torch.int32)
        q = torch.randn(num_q, heads * dim, generator=gen)
        outs = {name: torch.empty(num_q, heads * dim) for name in libs}
        med = race({name: (lib.kvmesh_prefill_attention_f32, (
            q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), table.data_ptr(),
            num_q, seq_len, outs[name].data_ptr(), heads * dim, heads, kv_heads, dim, block, dim**-0.5, window))
            for name, lib in libs.items()}, repeats)  # fmt: skip
        for name in libs:
            total[name] += med[name] if not window else 0.0
        keys = [min(seq_len - num_q + i + 1, window or seq_len) for i in range(num_q)]
        flops = 4 * dim * heads * sum(keys)
        print(f"prefill attention {num_q} queries at context {seq_len}, window {window}: "
              f"base {med['base'] * 1e3:.2f} ms "
              f"({flops / med['base'] / 1e9:.0f} GFLOP/s), new {med['new'] * 1e3:.2f} ms "
              f"({flops / med['new'] / 1e9:.0f}), new/base {med['new'] / med['base']:.3f}, "
              f"bitwise {torch.equal(outs['base'], outs['new'])}")  # fmt: skip
    print("prefill attention, both chunks of a 1,024-token prompt (no window): "
          f"new/base {total['new'] / total['base']:.3f}")


def bf16_attention(libs: dict[str, ctypes.CDLL], repeats: int) -> None:
    """Both attention kernels over a bf16 pool (bf16 mode's default): the prefill kernel on the two
    chunks of a 1,024-token prompt, the decode kernel on a batch of 32 at contexts 256 and 1,024.
    Where one build widens the pool into fp32 arithmetic and the other runs bf16 dot products, the
    outputs differ by bf16 rounding: the largest difference is printed beside the bitwise check."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    for seq_len, num_q in ((512, 512), (1024, 512)):
        gen = torch.Generator().manual_seed(seq_len)
        blocks = seq_len // block + 4
        k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen).to(torch.bfloat16)
                            for _ in range(2))  # fmt: skip
        table = torch.randperm(blocks, generator=gen)[: seq_len // block].to(torch.int32)
        q = torch.randn(num_q, heads * dim, generator=gen)
        outs = {name: torch.empty(num_q, heads * dim) for name in libs}
        med = race({name: (lib.kvmesh_prefill_attention_bf16, (
            q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), table.data_ptr(),
            num_q, seq_len, outs[name].data_ptr(), heads * dim, heads, kv_heads, dim, block, dim**-0.5, 0))
            for name, lib in libs.items()}, repeats)  # fmt: skip
        flops = 4 * dim * heads * sum(seq_len - num_q + i + 1 for i in range(num_q))
        _report(f"prefill attention, bf16 pool, {num_q} queries at context {seq_len}", med, flops, outs)
    batch = 32
    for ctx in (256, 1024):
        gen = torch.Generator().manual_seed(ctx)
        per = ctx // block + 1
        blocks = batch * per + 1
        k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen).to(torch.bfloat16)
                            for _ in range(2))  # fmt: skip
        tables = torch.randperm(blocks, generator=gen)[: batch * per].to(torch.int32).view(batch, per).contiguous()
        lens, rows = torch.full((batch,), ctx, dtype=torch.int32), torch.arange(batch, dtype=torch.int32)
        q = torch.randn(batch, heads * dim, generator=gen)
        outs = {name: torch.empty(batch, heads * dim) for name in libs}
        med = race({name: (lib.kvmesh_paged_decode_bf16, (
            q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), tables.data_ptr(),
            per, lens.data_ptr(), rows.data_ptr(), batch, outs[name].data_ptr(), heads * dim, heads, kv_heads, dim,
            block, ctx, dim**-0.5, 0)) for name, lib in libs.items()}, repeats)  # fmt: skip
        _report(f"decode attention, bf16 pool, batch {batch} at context {ctx}", med, 4 * dim * heads * ctx * batch,
                outs)  # fmt: skip


def _each(calls: Sequence[Call]) -> None:
    """Runs ``fn(*args)`` for each pair, in order: one timed turn of several kernel calls."""
    for fn, args in calls:
        fn(*args)


def decode_attention(libs: dict[str, ctypes.CDLL], contexts: Sequence[int], repeats: int,
                     in_cache: bool = False) -> None:
    """The decode kernel as a batch-32 step runs it, over an fp32 pool and a bf16 one (bf16 mode's):
    30 layers, each its own pool (so a pass streams every K/V byte from memory, as a step does: 283
    MB at context 192 in fp32), each sequence's blocks scattered over its layer's pool. ``in_cache``:
    every layer reads the same pool (4.7 MB over bf16 at context 192, from L3), the kernel's compute
    without most of the memory's wait."""
    heads, kv_heads, dim, block, batch, layers = 9, 3, 64, 16, 32, 30
    pools_made = 1 if in_cache else layers
    for dtype, fn in ((torch.float32, "kvmesh_paged_decode_f32"), (torch.bfloat16, "kvmesh_paged_decode_bf16")):
        for ctx in contexts:
            gen = torch.Generator().manual_seed(ctx)
            per = (ctx + block - 1) // block
            blocks = batch * per + 1
            made = [[torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
                    for _ in range(pools_made)]  # fmt: skip
            made_tables = [(torch.randperm(blocks - 1, generator=gen)[: batch * per] + 1).to(torch.int32)
                           .view(batch, per).contiguous() for _ in range(pools_made)]  # fmt: skip
            pools = [made[layer % pools_made] for layer in range(layers)]
            tables = [made_tables[layer % pools_made] for layer in range(layers)]
            lens, rows = torch.full((batch,), ctx, dtype=torch.int32), torch.arange(batch, dtype=torch.int32)
            q = torch.randn(batch, heads * dim, generator=gen)
            outs = {name: torch.empty(layers, batch, heads * dim) for name in libs}
            calls: dict[str, Call] = {}
            for name, lib in libs.items():
                kernel, out = getattr(lib, fn), outs[name]
                layer_calls = [(kernel, (
                    q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                    table.data_ptr(), per, lens.data_ptr(), rows.data_ptr(), batch, out[layer].data_ptr(),
                    heads * dim, heads, kv_heads, dim, block, ctx, dim**-0.5, 0))
                    for layer, ((k_cache, v_cache), table) in enumerate(zip(pools, tables, strict=True))]  # fmt: skip
                calls[name] = (_each, (layer_calls,))
            med = race(calls, repeats)
            gbytes = layers * batch * ctx * kv_heads * dim * dtype.itemsize * 2 / 1e9
            where = ", one pool for every layer (in cache)" if in_cache else ""
            print(f"decode attention, {str(dtype)[6:]} pool, batch {batch} at context {ctx}, {layers} layers{where} "
                  f"({gbytes * 1e3:.0f} MB of K/V read): "
                  f"base {med['base'] * 1e3:.2f} ms ({gbytes / med['base']:.1f} GB/s), "
                  f"new {med['new'] * 1e3:.2f} ms ({gbytes / med['new']:.1f}), "
                  f"new/base {med['new'] / med['base']:.3f}, bitwise {torch.equal(outs['base'], outs['new'])}")


def _report(what: str, med: dict[str, float], flops: float, outs: dict[str, torch.Tensor]) -> None:
    diff = float((outs["base"] - outs["new"]).abs().max())
    print(f"{what}: base {med['base'] * 1e3:.2f} ms ({flops / med['base'] / 1e9:.0f} GFLOP/s), "
          f"new {med['new'] * 1e3:.2f} ms ({flops / med['new'] / 1e9:.0f}), new/base {med['new'] / med['base']:.3f}, "
          f"bitwise {torch.equal(outs['base'], outs['new'])} (max difference {diff:.1e})")


def peaks(work: Path) -> None:
    avx512 = "avx512f" in cpu_flags()
    src = work / "peak.c"
    src.write_text(PEAK_C if avx512 else PEAK_AVX2_C)
    subprocess.run(["cc", "-O2", "-march=native", "-shared", "-fPIC", "-o", str(work / "peak.so"), str(src)],
                   check=True)  # fmt: skip
    lib = ctypes.CDLL(str(work / "peak.so"))
    for name, flops in (("peak_bf16", 64), ("peak_f32", 32)) if avx512 else (("peak_f32", 16),):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_long], ctypes.c_float
        n = 5_000_000
        t = race({name: (fn, (n,))}, 5)[name]
        print(f"{name} (register-only loop, one thread): {n * 12 * flops / t / 1e9:.0f} GFLOP/s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose kernels are the baseline")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", type=int, default=512, help="GEMM rows (a prefill chunk)")
    parser.add_argument("--step-rows", type=int, nargs="*", default=[],
                        help="also a whole step's fp32 GEMMs, weights streamed, at these row counts")  # fmt: skip
    parser.add_argument("--parts", default="peaks,gemms,attention",
                        help="which of peaks,gemms,q4_1,attention,bf16-attention,decode-attention to run")
    parser.add_argument("--contexts", type=int, nargs="*", default=[192, 512],
                        help="decode-attention: the batch's context lengths")
    parser.add_argument("--in-cache", action="store_true",
                        help="decode-attention: every layer reads one pool (K/V from L3), not 30 streamed ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvmesh-kernel-ab-") as tmp:
        libs = builds(args.base, Path(tmp))
        parts = args.parts.split(",")
        if "peaks" in parts:
            peaks(Path(tmp))
        if "gemms" in parts:
            gemms(libs, args.rows, args.repeats)
            step_gemms(libs, args.step_rows, args.repeats)
            step_gemms_bf16(libs, args.step_rows, args.repeats)
        if "q4_1" in parts:
            step_gemms_q4_1(libs, args.step_rows or [1], args.repeats)
        if "attention" in parts:
            attention(libs, args.repeats)
        if "bf16-attention" in parts:
            bf16_attention(libs, args.repeats)
        if "decode-attention" in parts:
            decode_attention(libs, args.contexts, args.repeats, args.in_cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
