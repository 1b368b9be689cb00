"""Builds a :class:`ModelRunner` from a :class:`RunnerConfig`: device, dtype, model, pool, backend.

Shared by the service's ``main.py`` and the in-process engine, so both build the runner the same way.
``dtype=auto`` and ``attention_backend=auto`` are resolved here, by pure functions of the device,
the CPU's feature flags (read once from ``/proc/cpuinfo``), whether the native kernels built and
the model's shape, so each choice can be tested for any machine (docs/model_runner.md, "auto").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.model_runner.attention.base import AttentionBackend
from services.model_runner.compute_thread import ComputeThread
from services.model_runner.config import WEIGHT_ONLY, RunnerConfig
from services.model_runner.cpu_bind import AUTO, NONE, allowed_cpus, parse_cpu_list
from services.model_runner.cpu_bind import resolve as resolve_cpus
from services.model_runner.kv_pool import KVPool, kv_dtype_for
from services.model_runner.loader import load_model, parse_dtype
from services.model_runner.model.config import ModelConfig
from services.model_runner.model.transformer import CausalLM
from services.model_runner.model.transforms import on_q4_1_grid
from services.model_runner.native import HALF_RATE_BF16_DOTS_VENDOR, cpu_vendor, cpuinfo_field, load_kernels
from services.model_runner.pool_populate import populate_in_background
from services.model_runner.runner import ModelRunner
from services.model_runner.streaming import check_streaming
from shared.errors import FailedPrecondition
from shared.kv_layout import layers_per_group
from shared.tensor_handle import dtype_name

log = logging.getLogger(__name__)

# CPU flags (as /proc/cpuinfo spells them) of bf16 hardware: AMX tiles (Sapphire Rapids and later)
# and AVX512-BF16 dot products (Zen 4 and 5, Cooper Lake, and Intel's AMX CPUs). Without them torch
# converts bf16 to fp32 around every op, slower than fp32 itself.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The native decode attention's limits (native/paged_decode.c: MAX_GROUP, MAX_HEAD_DIM).
NATIVE_MAX_GROUP = 16
NATIVE_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Choice:
    """A resolved setting and why it was chosen (shown in the log and ``GetModelInfo``)."""

    value: str
    reason: str


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    return frozenset(cpuinfo_field("flags").split())


def select_dtype(requested: str, device_type: str, flags: Iterable[str], quantization: str = "none",
                 bf16_kernels: bool = False, mla: bool = False, vendor: str = "", bf16_fma: bool = False) -> Choice:
    """``dtype=auto``: bf16 on a CPU with bf16 hardware *and* batch-invariant bf16 kernels built here
    (``bf16_kernels``) that run bf16 at full rate, fp32 elsewhere.

    Full rate: AMX tiles, AVX512-BF16 dot products on a CPU not from ``HALF_RATE_BF16_DOTS_VENDOR``
    (``vendor``, ``/proc/cpuinfo``'s ``vendor_id``), or bf16 mode's arithmetic as fp32 FMAs over
    widened bf16 values (``bf16_fma``: the kernels' choice on an Intel CPU without AMX,
    ``native.bf16_in_fma``). An Intel core runs ``vdpbf16ps`` at half its fp32 FMA rate, so bf16
    dot products there (``KVMESH_NATIVE_BF16=dots``) would make bf16 mode slower than fp32 mode:
    auto then picks fp32 (vLLM's bf16 default was slower than its fp32 on that machine too).

    bf16 needs both because the cache must never change the answer in the default mode: torch's
    bf16 GEMMs (oneDNN) pick their blocking by the row count, so a prefix hit, a chunked prefill
    or another batch would change a row's last bits and, at near-ties, its greedy token; only
    kernels with a fixed reduction order per row (``native/gemm_bf16.c``) make bf16 safe as a
    default. fp32 on a CPU without AMX-BF16 / AVX512-BF16 (bf16 would run as converted fp32:
    slower than fp32, and less exact), on CUDA (bf16 there has not been measured against the
    suite's tests) and under ``quantization`` (its packed weights start from fp32). An MLA model
    (``mla``) gets fp32: it runs on the torch backend only, whose bf16 GEMMs are not batch invariant.
    """
    if requested != "auto":
        return Choice(requested, "set explicitly")
    if mla:
        return Choice("float32", "auto: MLA runs on the torch backend only, whose bf16 GEMMs are not batch "
                                 "invariant (the cache could change the answer): float32")
    if device_type != "cpu":
        return Choice("float32", f"auto on {device_type}: float32 (the reference dtype)")
    if quantization == "int8_weight_only":
        return Choice("float32", "auto: quantization=int8_weight_only loads float32 weights and packs them as int8 "
                                 "(one scale per output channel) for the native int8 GEMM (bf16 GEMM inputs, fp32 "
                                 "accumulation and everything else)")
    if quantization == "q4_1":
        return Choice("float32", "auto: quantization=q4_1 loads float32 weights and packs the projections as Q4_1 "
                                 "and the head as Q8_0 groups for the native GEMM, fp32 over the dequantized "
                                 "weights (fp32 everything else)")
    if quantization not in ("none", "auto"):
        return Choice("float32", f"auto: quantization={quantization} packs fp32 weights")
    have = sorted(set(flags) & set(BF16_FLAGS))
    if not have:
        return Choice("float32", "auto: the CPU has no AMX-BF16 or AVX512-BF16 (bf16 would run as converted fp32)")
    if "amx_bf16" not in have and vendor == HALF_RATE_BF16_DOTS_VENDOR and bf16_kernels and not bf16_fma:
        return Choice("float32", "auto: an Intel CPU with AVX512-BF16 but no AMX-BF16, and bf16 mode set to dot "
                                 "products (KVMESH_NATIVE_BF16=dots): its cores run vdpbf16ps at half their fp32 "
                                 "FMA rate, so float32 is the faster dtype here")
    if not bf16_kernels:
        return Choice("float32", f"auto: the CPU has bf16 hardware ({', '.join(have)}) but no batch-invariant bf16 "
                                 "kernels built here (torch's bf16 GEMMs change their reduction order with the "
                                 "batch size, so the cache could change the answer)")
    return Choice("bfloat16", f"auto: the CPU computes bf16 in hardware ({', '.join(have)}) and the native "
                              "batch-invariant bf16 kernels built here")


def select_backend(
    requested: str, device_type: str, dtype: str, native_built: bool, num_heads: int, num_kv_heads: int,
    head_dim: int, bf16_kernels: bool = False, mla: bool = False,
) -> Choice:
    """``attention_backend=auto``: Triton on CUDA; on the CPU the native kernels (``cpu``) where
    they run this model exactly as tested (fp32, or bf16 where their bf16 GEMM is built:
    ``bf16_kernels``; built here, a head layout their decode kernel takes), else the torch
    reference. An MLA model (``mla``) runs on torch only, on any device.

    Raises:
        FailedPrecondition: ``triton`` or ``cpu`` requested for an MLA model.
    """
    if mla:
        if requested not in ("auto", "torch"):
            raise FailedPrecondition(f"attention_backend={requested} does not implement MLA (DeepSeek's latent KV); "
                                     "use torch or auto (docs/mla.md)")
        return Choice("torch", "set explicitly" if requested == "torch" else
                      "auto: MLA (latent KV) runs on the torch backend only")
    if requested != "auto":
        if requested == "cpu" and not native_built:
            return Choice("cpu", "set explicitly; the native kernels are not in use (not built here, or not "
                                 "float32): every op takes the torch path")
        return Choice(requested, "set explicitly")
    if device_type == "cuda":
        return Choice("triton", "auto on cuda: the Triton kernels")
    if device_type != "cpu":
        return Choice("torch", f"auto on {device_type}: the torch reference")
    if dtype == "bfloat16" and not bf16_kernels:
        return Choice("torch", "auto: the native kernels have no bf16 GEMM here (the CPU lacks AVX512-BF16), "
                               "the model is bfloat16")
    if dtype not in ("float32", "bfloat16"):
        return Choice("torch", f"auto: the native kernels take float32 or bfloat16 only, the model is {dtype}")
    if not native_built:
        return Choice("torch", "auto: the native kernels did not build here (no C compiler, or it failed)")
    if not native_takes(num_heads, num_kv_heads, head_dim):
        return Choice("torch", f"auto: the native decode kernel does not take {num_heads} heads over "
                               f"{num_kv_heads} KV heads of {head_dim}")
    if dtype == "bfloat16":
        return Choice("cpu", "auto: the native CPU kernels (built here; bf16 GEMMs with fp32 accumulation, "
                             "batch invariant)")
    return Choice("cpu", "auto: the native CPU kernels (built here, float32)")


def select_kv_dtype(requested: str, model_dtype: torch.dtype, native_bf16: bool, device_type: str) -> Choice:
    """``kv_cache_dtype=auto``: bf16 in bf16 mode on the native kernels, the model's dtype elsewhere.

    bf16 mode computes in fp32, but a decode step streams the KV pool as much as the weights (at
    batch 32 x 192 tokens of SmolLM2, 197 MB of fp32 KV beside 269 MB of bf16 weights); a bf16
    pool halves those bytes and doubles the blocks of a budget, as vLLM's CPU default does. The
    native kernels round on write (nearest even) and attend it in bf16 dot products where the build
    has AVX512-BF16 (widened exactly into fp32 arithmetic elsewhere: ``_bf16_attention_note``), the
    same way in the decode and the prefill kernel, so the cache still never changes the answer (a
    prefill row is the decode of its position, bit for bit);
    outputs differ from bf16 mode with an fp32 pool, which ``float32`` keeps (docs/kv_quantization.md).
    fp32 mode keeps an fp32 pool: it is the exact reference mode.

    Raises:
        FailedPrecondition: ``float32`` / ``bfloat16`` other than the model's dtype off the CPU
            (only the CPU backends convert between the pool's dtype and the compute dtype).
    """
    if requested == "auto":
        if native_bf16:
            return Choice("bfloat16", "auto: bf16 mode keeps K/V in bf16 (rounded to nearest even on write): "
                                      "half the fp32 pool's bytes")
        return Choice(dtype_name(model_dtype), "auto: the model's dtype")
    if requested in ("float32", "bfloat16") and device_type != "cpu" and parse_dtype(requested) != model_dtype:
        raise FailedPrecondition(f"kv_cache_dtype={requested} with {dtype_name(model_dtype)} weights runs on the CPU "
                                 f"only (the device is {device_type}): use auto")
    return Choice(requested, "set explicitly")


def native_takes(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native decode kernel takes this head layout (``paged_decode.c``'s limits)."""
    return not (num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > NATIVE_MAX_GROUP
                or head_dim > NATIVE_MAX_HEAD_DIM)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device, batch_invariant: bool = False, mla: bool = False) -> AttentionBackend:
    """``auto``: the Triton kernels on CUDA, the torch reference on CPU (``build_runner`` resolves
    ``auto`` with :func:`select_backend` before it gets here); ``batch_invariant`` for ``cpu``;
    ``mla``: the torch backend with MLA's latent attention (``attention/torch_mla.py``)."""
    if mla:
        if name not in ("auto", "torch"):
            raise FailedPrecondition(f"attention_backend={name} does not implement MLA; use torch")
        from services.model_runner.attention.torch_mla import TorchMLABackend

        return TorchMLABackend()
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from services.model_runner.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from services.model_runner.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(batch_invariant=batch_invariant)
    from services.model_runner.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def build_runner(config: RunnerConfig, flags: Iterable[str] | None = None, vendor: str | None = None) -> ModelRunner:
    """Loads the model, allocates the pool from the memory budget, picks the backend.

    Args:
        config: what to build; ``auto`` settings are resolved by :func:`select_dtype` and
            :func:`select_backend`.
        flags: the CPU's feature flags; default: this machine's (:func:`cpu_flags`).
        vendor: the CPU's ``vendor_id``; default: this machine's (:func:`cpu_vendor`) where
            ``flags`` is this machine's too, else none (a test's machine class given by its flags).
    """
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    cpu = cpu_flags() if flags is None else frozenset(flags)
    if vendor is None:
        vendor = cpu_vendor() if flags is None else ""
    mcfg0 = ModelConfig.from_dir(config.model_dir)
    bf16_kernels = not config.streaming and _bf16_kernels(config, device, cpu, mcfg0)
    mla = mcfg0.kv_layout == "mla"
    kernels = load_kernels() if bf16_kernels else None
    dtype_choice = select_dtype(config.dtype, device.type, cpu, config.quantization, bf16_kernels=bf16_kernels,
                                mla=mla, vendor=vendor, bf16_fma=kernels is not None and kernels.linear_bf16_fma)
    if config.streaming:
        backend_choice = streaming_backend(config, mcfg0)
    else:
        backend_choice = _select_backend(config.attention_backend, device, dtype_choice.value, mcfg0, bf16_kernels)
    # bf16 mode on the native kernels: fp32 weights as loaded, packed to bf16 by prepare_model
    native_bf16 = dtype_choice.value == "bfloat16" and bf16_kernels and backend_choice.value == "cpu"
    dtype = torch.float32 if native_bf16 else parse_dtype(dtype_choice.value)
    if config.quantization in WEIGHT_ONLY:
        _check_weight_only(config.quantization, device, cpu, backend_choice)
    model, mcfg = load_model(config.model_dir, dtype=dtype, device=device)
    native_fp32 = dtype_choice.value == "float32" and backend_choice.value == "cpu" and device.type == "cpu"
    quant_choice = select_quantization(config.quantization, native_fp32, lambda: _weights_on_q4_1_grid(model))
    if config.batch_invariant and (backend_choice.value != "cpu" or dtype != torch.float32
                                   or load_kernels() is None):
        raise ValueError(f"batch_invariant needs the native CPU kernels on float32 weights (fp32 or bf16 mode); "
                         f"here: dtype "
                         f"{dtype_choice.value}, attention backend {backend_choice.value} ({backend_choice.reason})")
    kv_choice = select_kv_dtype(config.kv_cache_dtype, dtype, native_bf16, device.type)
    backend_reason = backend_choice.reason + _bf16_attention_note(kv_choice.value, backend_choice.value, mcfg,
                                                                  config.block_size)
    log.info("dtype %s (%s); attention backend %s (%s); KV cache %s (%s)%s%s%s", dtype_choice.value,
             dtype_choice.reason, backend_choice.value, backend_reason, kv_choice.value, kv_choice.reason,
             "; batch invariant" if config.batch_invariant else "",
             "" if quant_choice.value == "none" else f"; quantization {quant_choice.value} ({quant_choice.reason})",
             _bf16_gemm_note() if native_bf16 else "")
    planes, heads, dim = mcfg.kv_cache_geometry
    pool = KVPool(
        num_layers=mcfg.num_layers, layer_slots=layers_per_group(mcfg.kv_groups), num_kv_heads=heads,
        head_dim=dim, planes=planes,
        block_size=config.block_size, memory_bytes=config.kv_cache_memory_bytes,
        dtype=kv_dtype_for(kv_choice.value, dtype), device=device, hadamard=config.kv_cache_hadamard,
    )
    if pool.path is not None:  # a CPU pool: its sparse pages allocated now, beside the rest of start-up
        populate_in_background(pool.tensor, f"KV pool {pool.path.name}")
    core = ModelRunner(
        model, pool, make_backend(backend_choice.value, device, config.batch_invariant, mla=mla),
        model_id=config.model_id or Path(config.model_dir).name,
        max_model_len=config.max_model_len or None, quantization=quant_choice.value,
        pack_tied_head=config.pack_tied_head, screen_head=config.screen_head,
        dtype_reason=dtype_choice.reason + (_bf16_gemm_note() if native_bf16 else "") + (
            f"; {quant_choice.reason}" if config.quantization == "auto" and quant_choice.value != "none" else ""),
        attention_backend_reason=backend_reason, gemm_dtype="bfloat16" if native_bf16 else "float32",
        streaming_sinks=config.streaming_sinks, streaming_window=config.streaming_window,
    )
    head = core.model.head_packing
    if head is not None and head.screen is not None:
        log.info("%s", head.screen.describe())
    core.compute = compute_thread(config, device)
    log.info("%s", core.compute.describe())
    if pool.is_fp8:
        core.calibrate_kv_scales()
    if config.warmup:
        core.compute.run(core.warmup)  # the team every step will use: started, sized and bound first
    return core


def compute_thread(config: RunnerConfig, device: torch.device) -> ComputeThread:
    """The runner's compute thread: ``num_threads`` and ``cpu_bind`` applied (CPU binding on the
    CPU only: a CUDA runner's thread only launches kernels).

    The team: ``num_threads``, else a CPU list's length, else torch's default on this thread (one
    per physical core: with SMT fewer than the CPUs, so ``auto`` then binds nothing), set on the
    compute thread explicitly: a new thread's OpenMP default is one per logical CPU.

    Raises:
        ValueError: ``cpu_bind`` lists a CPU this process may not run on.
    """
    listed = config.cpu_bind not in (AUTO, NONE)
    team = config.num_threads or (len(parse_cpu_list(config.cpu_bind)) if listed else torch.get_num_threads())
    cpus = resolve_cpus(config.cpu_bind, team, allowed_cpus()) if device.type == "cpu" else ()
    return ComputeThread(team, cpus, load_kernels() if cpus else None, device=device)


def select_quantization(requested: str, native_fp32: bool, on_grid: Callable[[], bool]) -> Choice:
    """``quantization=auto``: ``q4_1`` where the runner computes in float32 on the native kernels
    (``native_fp32``) and the loaded weights already lie on its grid (``on_grid``, asked only then:
    it quantizes every weight once), ``none`` elsewhere.

    On that grid the packing loses nothing: ``gemm_q4_1.c`` computes fp32 over the very same
    numbers, so the outputs are bitwise float32 mode's from a fifth of the weight bytes (a
    single-stream decode streams every weight once per token). A checkpoint dequantized from a
    llama.cpp Q4_1 file is such a model (the embedded SmolLM2 is); as vLLM reads a GPTQ or AWQ
    checkpoint's own format, the runner keeps the weights in the format they came in. A
    checkpoint trained in fp32 / bf16 is not on the grid (checked exactly, weight by weight) and
    keeps its fp32 weights: ``auto`` never changes an answer. bf16 mode keeps its own packing
    (its bf16 GEMMs run at twice the fp32 rate where it is picked).
    """
    if requested != "auto":
        return Choice(requested, "set explicitly")
    if not native_fp32:
        return Choice("none", "auto: the weights are packed as loaded (Q4_1 packing is for float32 on the native "
                              "kernels)")
    if not on_grid():
        return Choice("none", "auto: the weights are not all on llama.cpp's Q4_1 / Q8_0 grid (packing them so "
                              "would change the answer)")
    return Choice("q4_1", "weights: every projection on llama.cpp's Q4_1 grid and the head on Q8_0's (checked at "
                          "load), kept so (quantization auto: q4_1): fp32 arithmetic over the same numbers, bitwise "
                          "float32 mode, a fifth of the weight bytes")


def _weights_on_q4_1_grid(model: CausalLM) -> bool:
    kernels = load_kernels()
    return kernels is not None and on_q4_1_grid(model, kernels.q_group)


def streaming_backend(config: RunnerConfig, mcfg: ModelConfig) -> Choice:
    """Attention-sinks mode's backend: torch, the only one with its attention (``auto`` picks it).

    Checked before the weights load, so a bad setting fails fast (the runner checks again).

    Raises:
        FailedPrecondition: ``triton`` or ``cpu`` asked explicitly, or a model / KV dtype the mode
            does not take (``streaming.check_streaming``).
    """
    if config.attention_backend not in ("auto", "torch"):
        raise FailedPrecondition(f"attention sinks (streaming_sinks={config.streaming_sinks}) run on the torch "
                                 f"attention backend only, not {config.attention_backend!r}: set "
                                 "KVMESH_RUNNER_ATTENTION_BACKEND to auto or torch")
    check_streaming(mcfg, "torch", config.kv_cache_dtype, config.streaming_sinks, config.streaming_window)
    if config.attention_backend == "torch":
        return Choice("torch", "set explicitly")
    return Choice("torch", "auto: attention sinks (streaming_sinks) run on the torch backend only")


def _select_backend(requested: str, device: torch.device, dtype: str, mcfg: ModelConfig,
                    bf16_kernels: bool) -> Choice:
    # NOTE: the kernels are built (or found built) only when the choice depends on them.
    needs_build = (device.type == "cpu" and (dtype == "float32" or bf16_kernels) and requested in ("auto", "cpu")
                   and mcfg.kv_layout != "mla")
    native_built = needs_build and load_kernels() is not None
    return select_backend(requested, device.type, dtype, native_built, mcfg.num_heads, mcfg.num_kv_heads,
                          mcfg.head_dim, bf16_kernels=bf16_kernels, mla=mcfg.kv_layout == "mla")


def _check_weight_only(quantization: str, device: torch.device, flags: frozenset[str], backend: Choice) -> None:
    """A ``WEIGHT_ONLY`` quantization runs only on its native GEMM (``int8_weight_only``: the int8
    one, which needs AVX512-BF16; ``q4_1``: gemm_q4_1.c, in every native build): refuse, with the
    reason, anything else (there is no torch fallback of the same arithmetic)."""
    int8 = quantization == "int8_weight_only"
    kernels = load_kernels() if device.type == "cpu" else None
    why = ""
    if device.type != "cpu":
        why = f"the device is {device.type}"
    elif backend.value != "cpu":
        why = f"the attention backend is {backend.value} ({backend.reason})"
    elif int8 and not flags & set(BF16_FLAGS):
        why = "the CPU has no AVX512-BF16 / AMX-BF16"
    elif kernels is None:
        why = "the native kernels did not build"
    elif int8 and kernels.linear_int8 is None:
        why = "the native int8 GEMM did not build here (a compiler without -mavx512bf16?)"
    if why:
        needs = "int8 GEMM (a CPU with AVX512-BF16)" if int8 else "Q4_1 GEMM (gemm_q4_1.c)"
        raise ValueError(f"quantization={quantization} needs the native CPU kernels' {needs}; here {why}")


def _bf16_gemm_note() -> str:
    """Which kernel bf16 mode's GEMMs run on in this process (chosen once, when the kernels load)."""
    kernels = load_kernels()
    if kernels is not None and kernels.linear_bf16_amx:
        return "; bf16 GEMMs on AMX tiles (native/gemm_amx.c)"
    if kernels is not None and kernels.linear_bf16_fma:
        return "; bf16 weights and KV widened into fp32 FMAs, activations unrounded (native/gemm_bf16.c, fma)"
    return "; bf16 GEMMs on AVX512-BF16 (native/gemm_bf16.c)"


def _bf16_attention_note(kv_dtype: str, backend: str, mcfg: ModelConfig, block_size: int) -> str:
    """How the native kernels attend a bf16 pool in this process: on AMX tiles where the bf16 GEMMs
    run on AMX (``native/kv_elem.h``'s ``kv_amx``), else in bf16 dot products where the build has
    AVX512-BF16 and the shape allows (``kv_bf16_dots``), else in fp32 over the widened values. Each
    gives a prefill row the decode's bits; their bits differ."""
    if kv_dtype != "bfloat16" or backend != "cpu":
        return ""
    kernels = load_kernels()
    if kernels is not None and kernels.kv_amx_for is not None and kernels.kv_amx_for(
            mcfg.num_heads, mcfg.head_dim, block_size):
        return "; a bf16 pool attended on AMX tiles (TDPBF16PS, fp32 sums)"
    if kernels is not None and kernels.bf16_dots_for is not None and kernels.bf16_dots_for(
            mcfg.num_heads, mcfg.head_dim, block_size):
        return "; a bf16 pool attended in bf16 dot products (vdpbf16ps, fp32 sums)"
    return "; a bf16 pool attended in fp32 (K/V widened)"


def _bf16_kernels(config: RunnerConfig, device: torch.device, flags: frozenset[str], mcfg: ModelConfig) -> bool:
    """Whether this runner can run bf16 mode on the native kernels: a CPU with bf16 hardware, the
    native backend allowed, no quantization, a head layout the decode kernel takes, and the bf16
    GEMM built (the kernels are built only when all the rest holds)."""
    if device.type != "cpu" or config.quantization not in ("none", "auto") or config.attention_backend not in (
            "auto", "cpu"):
        return False
    if mcfg.kv_layout == "mla":  # the native kernels do not run MLA
        return False
    if not flags & set(BF16_FLAGS) or not native_takes(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim):
        return False
    kernels = load_kernels()
    return kernels is not None and kernels.linear_bf16 is not None
