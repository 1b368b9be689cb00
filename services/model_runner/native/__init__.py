"""Native (C/OpenMP) CPU kernels, compiled on first use with the machine's C compiler.

What is here, and why torch alone was not enough (measurements in docs/model_runner.md):

* ``paged_decode.c`` — decode attention reading the paged KV cache in place (torch has no op that
  reads a paged cache, so the torch backend gathers K/V into contiguous buffers first), and the
  K/V slot writes; an fp32 or a bf16 pool (``kv_elem.h``: bf16 attended in ``vdpbf16ps`` dot
  products where the CPU has AVX512-BF16, else widened exactly on load; rounded
  to nearest even on write), as ``prefill_attention.c`` and ``decode_stack.c``;
* ``prefill_attention.c`` — causal attention of a prefill chunk over the paged cache as small
  register-blocked GEMMs (torch's SDPA over a chunk ran at a fraction of the FMA rate), each row's
  numbers independent of how its prompt was chunked (``prefill_attention_avx2.c``: the same in 8
  lanes for a CPU with AVX2 but no AVX-512);
* ``attention_amx.c`` — both attention kernels over a bf16 pool on AMX tiles, in one order, where
  the process runs its bf16 GEMMs on AMX (``kv_elem.h``'s ``kv_amx``): an Intel core issues
  ``vdpbf16ps`` at half its fp32 FMA rate, and long prefills spent half their time in attention;
* ``layer_ops.c`` — fused residual-add + RMSNorm, rotary embedding and SwiGLU: at decode batch
  sizes torch runs each as several tiny ops with an OpenMP fork each;
* ``gemm.c`` — fp32 linear layers on weights packed into column panels, with the next panel
  prefetched while the current one is computed: a decode step's skinny GEMMs are as much a memory
  stream as FLOPs, and oneDNN's inner product does the two one after the other (AVX-512, AVX2 +
  FMA and plain-C tiles, each row's result independent of the rows beside it);
* ``gemm_bf16.c`` — the same on bf16 weights and bf16-rounded activations with fp32 accumulation
  (AVX512-BF16's ``vdpbf16ps``; only where the CPU has it): bf16 mode's GEMMs, batch invariant by
  construction, which torch's bf16 GEMMs are not; and the gate_up GEMM with SwiGLU in its
  epilogue (prefill chunks: the [T, 2I] projection is never written out and read back);
* ``gemm_amx.c`` — the bf16 GEMMs on AMX tiles (``TDPBF16PS``; Sapphire Rapids and later) on the
  same packed weights, chosen once per process when the object loads (``KVMESH_NATIVE_AMX=0``
  keeps the AVX512-BF16 kernel) and then used for every row count and both entry points, so a
  row's bits never depend on its batch (``NativeKernels.linear_bf16_amx`` says which one runs);
  and a third on the same weights, fp32 FMAs over the widened bf16 values with x unrounded
  (``KVMESH_NATIVE_BF16=fma``, ``NativeKernels.linear_bf16_fma``): for a CPU whose ``vdpbf16ps``
  runs at half its FMA rate (Intel without AMX; docs/model_runner.md, "auto");
* ``gemm_int8.c`` — the same arithmetic on int8 weights with a scale per output channel, widened
  to bf16 in registers (``quantization=int8_weight_only``): half bf16 mode's weight bytes, for
  single-stream decode, which streams every weight once per token;
* ``gemm_q4_1.c`` — weight-only groups of 32 in llama.cpp's Q4_1 (4-bit codes, a scale and a
  minimum; the projections) and Q8_0 (8-bit codes, a scale; the head) formats, dequantized to fp32
  exactly as gguf-py does and run as ``gemm.c``'s fp32 GEMM over them (``quantization=q4_1``):
  a fifth of fp32's weight bytes, no bf16 hardware needed, and bitwise fp32 mode on a checkpoint
  whose weights lie on that grid (the embedded SmolLM2);
* ``head_argmax.c`` — greedy decoding's head: each row's argmax over the packed GEMM's columns,
  block by block, without writing the logits;
* ``decode_stack.c`` — a step's whole layer stack in one call (decode rows and prefill chunks):
  the kernels above in the per-layer order, without the Python between them
  (``model/native_stack.py``);
* ``int4_kv.c`` — the INT4 KV cache's slot writes (quantize + pack, byte for byte
  ``attention/int4.py``) and paged attention reading the packed rows in place (decodes and prefill
  rows alike, each row as the decode of its position);
* ``thread_team.c`` — the calling thread's OpenMP team: its size, and each member bound to a CPU
  (the model-runner's compute thread, ``compute_thread.py``);
* ``exp_math.h`` — the exponential they use; ``kernels.h`` — the entry points' declarations;
  ``gemm_bf16.h`` — what the two bf16 GEMM files share; ``prefill_tiles.h`` — what the two tiled
  prefill attention kernels share; ``pairs.h`` — how the GEMM and decode
  attention split work over threads; ``panel_prefetch.h`` — the GEMMs' prefetch of the next
  weight panel; ``tile_avx2.h`` — the AVX2 fp32 row tile's registers and k step (``gemm.c``, and
  ``gemm_q4_1.c``'s first tile).

The sources are built together into one shared object in a cache folder
(``$KVMESH_NATIVE_CACHE``, else ``$KVMESH_CACHE_DIR/native``, else ``~/.cache/kvmesh/native``),
named by a hash of the sources, the flags, the compiler and the CPU's feature flags, so a changed
source or another machine never loads a stale build. ``-march=native`` is right because the build
happens on the machine that runs it. The build runs once per machine and source version; a missing compiler or a failed
build only logs a warning and :func:`load_kernels` returns None, and callers keep the torch path.
The object links the ``libgomp`` torch already loaded (same soname), so ``torch.set_num_threads``
governs its threads too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# NOTE: no -ffast-math: a shared object built with it turns on flush-to-zero for the whole
# process when it is loaded. No -Werror either: another compiler's new warning must not disable
# the kernels on a user's machine (the tests build with -Werror to keep the sources clean).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-Wall")
# What a CPU without AVX-512 runs (the GEMM's AVX2 tile where it has AVX2 + FMA, the plain C
# loops otherwise); the tests check both variants.
PORTABLE_CFLAGS = ("-mno-avx512f",)
# What a CPU without AVX2 runs (the plain C loops everywhere: older x86 CPUs, and the code other
# architectures compile): tests check its numbers too, so a machine without it still pins them.
PLAIN_CFLAGS = ("-mno-avx512f", "-mno-avx2", "-mno-fma")
# The build without AMX (the bf16 GEMM's AVX512-BF16 kernel on an AMX CPU): the tests run each bf16
# GEMM test on both kernels in one process (a process uses one of them, chosen when loaded).
NO_AMX_CFLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
BF16_FMA_CFLAGS = (*NO_AMX_CFLAGS, "-DKVMESH_BF16_FMA")  # bf16 mode's arithmetic in fp32 FMAs (bf16_in_fma)
# The vendor (``vendor_id``) whose cores run AVX512-BF16's dot product at half their fp32 FMA rate:
# measured on an Intel Xeon whose AMX is not exposed (family 6, model 207), ``vdpbf16ps`` 83 GFLOP/s
# against ``vfmadd231ps`` 164 (docs/model_runner.md, "auto"). AMD's Zen 4 and 5 run it at about
# twice their fp32 rate.
HALF_RATE_BF16_DOTS_VENDOR = "GenuineIntel"
BF16_SETTINGS = ("auto", "fma", "dots")  # KVMESH_NATIVE_BF16
# The vendor whose decode attention prefetches the next K/V block into L2 rather than L1
# (paged_decode.c's KV_PREFETCH_HINT; the measurements: docs/model_runner.md, "Decode attention's
# prefetch on AMD"). A hint: the bits are the same.
L2_KV_PREFETCH_VENDOR = "AuthenticAMD"
KV_PREFETCH_L2_CFLAGS = ("-DKVMESH_KV_PREFETCH_L2",)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_F32 = ctypes.c_float


def is_cpu_fp32(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor the native kernels take (fp32, in CPU memory)."""
    return t.device.type == "cpu" and t.dtype == torch.float32


def is_cpu_kv(t: torch.Tensor) -> bool:
    """Whether ``t`` is a KV cache the native attention kernels read and write (fp32 or bf16, CPU)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def cache_dir() -> Path:
    """Where built objects go."""
    explicit = os.environ.get("KVMESH_NATIVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("KVMESH_CACHE_DIR") or str(Path.home() / ".cache" / "kvmesh")
    return Path(base).expanduser() / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpuinfo_field(key: str) -> str:
    """The first processor's ``key`` line of ``/proc/cpuinfo``, after the colon (empty where there
    is none): the one reader of that file for the flags and the vendor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``; empty where there is none)."""
    return cpuinfo_field("vendor_id")


def bf16_in_fma(flags: frozenset[str], vendor: str, setting: str = "auto") -> bool:
    """Whether bf16 mode's arithmetic runs as fp32 FMAs over widened bf16 weights and KV (the
    ``BF16_FMA_CFLAGS`` build) rather than ``vdpbf16ps`` dot products: ``setting``
    (``KVMESH_NATIVE_BF16``) ``fma`` or ``dots`` decides; ``auto`` picks the FMAs on a CPU from
    ``HALF_RATE_BF16_DOTS_VENDOR`` without AMX-BF16 (with AMX the GEMMs run on tiles). A rule on the
    vendor, not a timing at start-up: a measured choice could differ between two replicas of one
    mesh and make their answers differ.

    Raises:
        ValueError: a setting outside ``BF16_SETTINGS``.
    """
    if setting not in BF16_SETTINGS:
        raise ValueError(f"KVMESH_NATIVE_BF16 must be one of {', '.join(BF16_SETTINGS)}, not {setting!r}")
    if setting != "auto":
        return setting == "fma"
    return vendor == HALF_RATE_BF16_DOTS_VENDOR and "amx_bf16" not in flags


def kv_prefetch_into_l2(vendor: str) -> bool:
    """Whether decode attention prefetches the next K/V block into L2 on a CPU of ``vendor`` (the
    ``KV_PREFETCH_L2_CFLAGS`` build): a rule on the vendor, as :func:`bf16_in_fma`."""
    return vendor == L2_KV_PREFETCH_VENDOR


def kv_prefetch_cflags(into_l2: bool | None = None) -> tuple[str, ...]:
    """The compiler flags for decode attention's prefetch target: the one place the loader and
    ``bench/kernel_ab.py`` get them. ``into_l2`` None: :func:`kv_prefetch_into_l2` on this CPU."""
    if into_l2 is None:
        into_l2 = kv_prefetch_into_l2(cpu_vendor())
    return KV_PREFETCH_L2_CFLAGS if into_l2 else ()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(sources: tuple[Path, ...] = SOURCES, extra_cflags: tuple[str, ...] = ()) -> Path:
    """Compiles ``sources`` into one shared object unless an identical build is cached.

    Returns:
        The shared object's path.

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its output is in the message).
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError as exc:
        raise RuntimeError(f"cannot run the C compiler {cc}: {exc}") from exc
    flags = (*CFLAGS, *extra_cflags)
    parts = [*(f"{s.name}\0{s.read_text()}" for s in (*sources, *HEADERS)), " ".join(flags), version,
             platform.machine(), _cpu_flags()]  # fmt: skip
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"kvmesh_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], capture_output=True, text=True,
                              check=False)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True)
class NativeKernels:
    """The entry points (ctypes functions; tensors are passed as raw pointers and strides)."""

    paged_decode: Any  # kvmesh_paged_decode_f32
    write_kv: Any  # kvmesh_write_kv_f32
    prefill_attention: Any  # kvmesh_prefill_attention_f32
    add_rms_norm: Any  # kvmesh_add_rms_norm_f32
    rope: Any  # kvmesh_rope_f32
    silu_mul: Any  # kvmesh_silu_mul_f32
    linear: Any  # kvmesh_linear_f32
    panel_width: int  # kvmesh_linear_panel_width(): output columns per packed weight panel
    decode_stack: Any  # kvmesh_decode_stack_f32
    linear_bf16: Any | None = None  # kvmesh_linear_bf16; None unless built for AVX512-BF16 (this CPU has it)
    write_kv_int4: Any | None = None  # kvmesh_write_kv_int4
    paged_attention_int4: Any | None = None  # kvmesh_paged_attention_int4
    linear_int8: Any | None = None  # kvmesh_linear_int8; None unless built for AVX512-BF16, as linear_bf16
    linear_q4_1: Any = None  # kvmesh_linear_q4_1 (every build; the default only keeps hand-made NativeKernels valid)
    linear_q8_0: Any = None  # kvmesh_linear_q8_0 (as linear_q4_1)
    q_group: int = 32  # kvmesh_linear_q_group(): weights along k per Q4_1 / Q8_0 scale
    linear_bf16_swiglu: Any | None = None  # kvmesh_linear_bf16_swiglu (gate_up GEMM + SwiGLU); as linear_bf16
    linear_f32_swiglu: Any = None  # kvmesh_linear_f32_swiglu (fp32 gate_up GEMM + SwiGLU; every build, as linear_q4_1)
    linear_bf16_amx: bool = False  # kvmesh_linear_bf16_amx(): the bf16 GEMMs run on AMX tiles (gemm_amx.c)
    # kvmesh_linear_bf16_fma(): bf16 mode's GEMMs and attention run fp32 FMAs over widened bf16 values
    linear_bf16_fma: bool = False
    # kvmesh_bf16_dots_for(num_heads, head_dim, block_size): whether a bf16 pool of that shape is attended
    # in bf16 dot products (kv_elem.h's kv_bf16_dots, the one owner of the rule)
    bf16_dots_for: Any = None
    # kvmesh_kv_amx_for(num_heads, head_dim, block_size): whether a bf16 pool of that shape is attended on
    # AMX tiles instead (kv_elem.h's kv_amx: where the bf16 GEMMs run on AMX; attention_amx.c)
    kv_amx_for: Any = None
    kv_prefetch_l2: bool = False  # kvmesh_kv_prefetch_l2(): decode attention prefetches K/V into L2, not L1
    # the attention kernels over a bf16 pool (same arguments; the caches uint16): always built, the
    # defaults only keep hand-made NativeKernels valid
    paged_decode_bf16: Any = None  # kvmesh_paged_decode_bf16
    prefill_attention_bf16: Any = None  # kvmesh_prefill_attention_bf16
    write_kv_bf16: Any = None  # kvmesh_write_kv_bf16
    # kvmesh_linear_argmax: each row's argmax over a packed fp32 or bf16 GEMM's columns without writing
    # the logits (greedy decoding's head); None unless built for AVX-512
    linear_argmax: Any | None = None
    # kvmesh_head_screen_argmax: linear_argmax's fp32 result, the columns scored in bf16 first and only
    # those that could be a row's maximum computed in fp32 (head_screen.c); None unless built for
    # AVX512-BF16. head_screen_work_bytes(m, k, n, cap): the workspace it needs
    head_screen: Any | None = None
    head_screen_work_bytes: Any = None
    # kvmesh_head_screen_int8_argmax: a head scored in int8 dot products (screen_int8.c), bf16 mode's
    # (its last-but-one argument 1: bf16 survivors) or fp32 mode's (0: fp32 survivors, as head_screen's);
    # None unless built for AVX512-BF16 and AVX512-VNNI
    head_screen_int8: Any | None = None
    screen_group: int = 32  # kvmesh_screen_int8_group(): weights along k per int8 step of that screen
    team_size: Any = None  # kvmesh_team_size(): threads of a parallel region the calling thread opens
    bind_team: Any = None  # kvmesh_bind_team(cpus int64 [n], n): the calling thread's team, member i on cpus[i]


    @property
    def attention_bf16_dots(self) -> bool:
        """Whether this build attends a bf16 pool in bf16 dot products at all (AVX512-BF16)."""
        return self.bf16_dots_for is not None and bool(self.bf16_dots_for(1, 32, 2))


def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


@functools.cache
def load_kernels(portable: bool = False, no_amx: bool = False, plain: bool = False,
                 bf16_fma: bool | None = None, kv_prefetch_l2: bool | None = None) -> NativeKernels | None:
    """The built kernels, or None when they cannot be built here (logged once).

    Args:
        portable: the variant without the AVX-512 paths (AVX2 where the CPU has it; for tests).
        no_amx: the variant built without AMX, whose bf16 GEMMs run the AVX512-BF16 kernel (for tests).
        plain: the variant without AVX2 either: the plain C loops (for tests).
        bf16_fma: whether bf16 mode runs fp32 FMAs over widened bf16 weights and KV
            (``gemm_bf16.c``'s third kernel) or ``vdpbf16ps``; None: :func:`bf16_in_fma` on this
            machine and ``KVMESH_NATIVE_BF16`` (True / False: that variant, for tests).
        kv_prefetch_l2: whether decode attention prefetches K/V blocks into L2
            (``KV_PREFETCH_L2_CFLAGS``); None: on ``L2_KV_PREFETCH_VENDOR``'s CPUs.
    """
    if bf16_fma is None:
        bf16_fma = not (portable or plain or no_amx) and bf16_in_fma(
            frozenset(_cpu_flags().split()), cpu_vendor(), os.environ.get("KVMESH_NATIVE_BF16") or "auto")
    # NOTE: torch is imported at the top of this module, so its libgomp is loaded before the
    # kernels' object and both share one thread pool.
    flags = (*(PORTABLE_CFLAGS if portable else ()), *(PLAIN_CFLAGS if plain else ()),
             *(NO_AMX_CFLAGS if no_amx else ()), *(BF16_FMA_CFLAGS if bf16_fma else ()),
             *kv_prefetch_cflags(kv_prefetch_l2))
    try:
        lib = ctypes.CDLL(str(build(extra_cflags=flags)))
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return None
    bf16 = bool(_bind(lib, "kvmesh_linear_bf16_available", _I64, [])())
    paged_decode_args = [
        _PTR, _I64,  # q, q_row_stride
        _PTR, _PTR, _I64,  # k_cache, v_cache, block_stride (elements)
        _PTR, _I64,  # tables, table_stride
        _PTR, _PTR, _I64,  # seq_lens, rows, num_seqs
        _PTR, _I64,  # out, out_row_stride
        _I64, _I64, _I64, _I64,  # num_heads, num_kv_heads, head_dim, block_size
        _I64, _F32, _I64,  # max_seq_len, scale, window (0 = full attention)
    ]
    prefill_args = [
        _PTR, _I64,  # q (the chunk's first row), q_row_stride
        _PTR, _PTR, _I64,  # k_cache, v_cache, block_stride (elements)
        _PTR, _I64, _I64,  # table (int32), num_q, seq_len
        _PTR, _I64,  # out (the chunk's first row), out_row_stride
        _I64, _I64, _I64, _I64, _F32,  # num_heads, num_kv_heads, head_dim, block_size, scale
        _I64,  # window (0 = full attention)
    ]
    write_kv_args = [
        _PTR, _I64, _PTR, _I64,  # key, key_row_stride, value, value_row_stride (fp32)
        _PTR, _PTR, _PTR, _I64, _I64, _I64,  # k_cache, v_cache, slots, num_tokens, kv_elems, num_slots
    ]
    return NativeKernels(
        paged_decode=_bind(lib, "kvmesh_paged_decode_f32", ctypes.c_int, paged_decode_args),
        prefill_attention=_bind(lib, "kvmesh_prefill_attention_f32", ctypes.c_int, prefill_args),
        write_kv=_bind(lib, "kvmesh_write_kv_f32", _I64, write_kv_args),
        paged_decode_bf16=_bind(lib, "kvmesh_paged_decode_bf16", ctypes.c_int, paged_decode_args),
        prefill_attention_bf16=_bind(lib, "kvmesh_prefill_attention_bf16", ctypes.c_int, prefill_args),
        write_kv_bf16=_bind(lib, "kvmesh_write_kv_bf16", _I64, write_kv_args),
        add_rms_norm=_bind(lib, "kvmesh_add_rms_norm_f32", None, [
            _PTR, _PTR, _I64, _PTR,  # residual (or NULL), x, x_stride, weight
            _PTR, _I64, _I64, _F32,  # out, rows, hidden, eps
        ]),
        rope=_bind(lib, "kvmesh_rope_f32", None, [
            _PTR, _I64, _PTR, _PTR, _I64,  # x, x_stride, cos, sin, cs_stride
            _PTR, _I64, _I64, _I64,  # out, tokens, heads, dim
        ]),
        silu_mul=_bind(lib, "kvmesh_silu_mul_f32", None, [
            _PTR, _I64, _PTR, _I64, _I64,  # gate_up, stride, out, tokens, size
        ]),
        linear=_bind(lib, "kvmesh_linear_f32", None, [
            _PTR, _I64, _I64, _I64,  # x, x_stride, m, k
            _PTR, _I64, _PTR,  # packed, n, bias (or NULL)
            _PTR, _I64,  # out, out_stride
        ]),
        linear_f32_swiglu=_bind(lib, "kvmesh_linear_f32_swiglu", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x, x_stride, m, k
            _PTR, _I64, _PTR,  # packed gate_up, intermediate size, bias [2 inter] (or NULL)
            _PTR, _I64,  # out [m, inter], out_stride
        ]),
        panel_width=int(_bind(lib, "kvmesh_linear_panel_width", _I64, [])()),
        decode_stack=_bind(lib, "kvmesh_decode_stack_f32", ctypes.c_int, [
            _PTR, _I64, _PTR, _PTR,  # layers (KvmLayer[]), num_layers, shape, step
        ]),
        linear_bf16=_bind(lib, "kvmesh_linear_bf16", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR,  # packed (bf16, pack_panels_bf16), n, bias (or NULL)
            _PTR, _I64,  # out, out_stride
        ]) if bf16 else None,
        linear_bf16_swiglu=_bind(lib, "kvmesh_linear_bf16_swiglu", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR,  # packed gate_up (bf16), intermediate size, bias [2 inter] (or NULL)
            _PTR, _I64,  # out [m, inter], out_stride
        ]) if bf16 else None,
        write_kv_int4=_bind(lib, "kvmesh_write_kv_int4", _I64, [
            _PTR, _I64, _PTR, _I64,  # key, key_row_stride, value, value_row_stride (fp32 elements)
            _PTR, _PTR, _PTR, _I64,  # k_cache, v_cache (uint8), slots (int64), num_tokens
            _I64, _I64, _I64,  # num_kv_heads, head_dim, num_slots
        ]),
        paged_attention_int4=_bind(lib, "kvmesh_paged_attention_int4", ctypes.c_int, [
            _PTR, _I64,  # q, q_row_stride
            _PTR, _PTR, _I64,  # k_cache, v_cache (uint8), block_stride (bytes)
            _PTR, _I64,  # tables (int32, one row per query row), table_stride
            _PTR, _PTR, _I64,  # seq_lens (each row's keys), rows, num_rows
            _PTR, _I64,  # out, out_row_stride
            _I64, _I64, _I64, _I64,  # num_heads, num_kv_heads, head_dim, block_size
            _I64, _F32, _I64,  # max_seq_len, scale, window (0 = full attention)
        ]),
        linear_int8=_bind(lib, "kvmesh_linear_int8", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR,  # packed (scales, then int8 panels: pack_int8), n, bias (or NULL)
            _PTR, _I64,  # out, out_stride
        ]) if _bind(lib, "kvmesh_linear_int8_available", _I64, [])() else None,
        linear_q4_1=_bind(lib, "kvmesh_linear_q4_1", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR,  # packed (pack_q_groups, 4 bits), n, bias (or NULL)
            _PTR, _I64,  # out, out_stride
        ]),
        linear_q8_0=_bind(lib, "kvmesh_linear_q8_0", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR,  # packed (pack_q_groups, 8 bits), n, bias (or NULL)
            _PTR, _I64,  # out, out_stride
        ]),
        q_group=int(_bind(lib, "kvmesh_linear_q_group", _I64, [])()),
        linear_bf16_amx=bf16 and bool(_bind(lib, "kvmesh_linear_bf16_amx", _I64, [])()),
        linear_bf16_fma=bf16 and bool(_bind(lib, "kvmesh_linear_bf16_fma", _I64, [])()),
        bf16_dots_for=_bind(lib, "kvmesh_bf16_dots_for", _I64, [_I64, _I64, _I64]),
        kv_amx_for=_bind(lib, "kvmesh_kv_amx_for", _I64, [_I64, _I64, _I64]),
        kv_prefetch_l2=bool(_bind(lib, "kvmesh_kv_prefetch_l2", _I64, [])()),
        linear_argmax=_bind(lib, "kvmesh_linear_argmax", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _I64, _PTR, _I64,  # packed (pack_panels or pack_panels_bf16), n, bias (or NULL), bf16
            _PTR, _I64, _PTR,  # scratch [m, block_cols] fp32, block_cols, out [m] int64
        ]) if _bind(lib, "kvmesh_linear_argmax_available", _I64, [])() else None,
        head_screen=_bind(lib, "kvmesh_head_screen_argmax", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _PTR, _I64, _PTR,  # packed (pack_panels), dense [n, k] rows (or NULL), n, bias (or NULL)
            _PTR, _PTR,  # screen (pack_panels_bf16 of the same weight), norm [n] fp32
            _PTR, _I64, _PTR, _I64, _PTR,  # scratch [m, block_cols] fp32, block_cols, work, cap, out [m] int64
        ]) if _bind(lib, "kvmesh_head_screen_available", _I64, [])() else None,
        head_screen_work_bytes=_bind(lib, "kvmesh_head_screen_work_bytes", _I64, [_I64, _I64, _I64, _I64]),
        screen_group=int(_bind(lib, "kvmesh_screen_int8_group", _I64, [])()),
        head_screen_int8=_bind(lib, "kvmesh_head_screen_int8_argmax", ctypes.c_int, [
            _PTR, _I64, _I64, _I64,  # x (fp32), x_stride, m, k
            _PTR, _PTR, _I64, _PTR,  # packed (pack_panels_bf16 / pack_panels), dense [n, k] rows (or NULL), n, bias
            _PTR, _PTR, _PTR, _PTR, _PTR,  # codes, scale, offset (pack_screen_int8), c1 [n], c2 [n] fp32
            _PTR, _I64, _PTR, _I64, _I64, _PTR,  # scratch [m, block_cols], block_cols, work, cap, bf16, out [m] int64
        ]) if _bind(lib, "kvmesh_head_screen_int8_available", _I64, [])() else None,
        team_size=_bind(lib, "kvmesh_team_size", _I64, []),
        bind_team=_bind(lib, "kvmesh_bind_team", ctypes.c_int, [_PTR, _I64]),
    )  # fmt: skip
