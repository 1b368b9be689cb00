"""``dtype=auto`` and ``attention_backend=auto``: what each machine gets, and why.

The choices are pure functions of the device, the CPU's flags, whether the native kernels built
and the model's heads, so each machine class is tested here from its flags (those below are
the relevant part of ``/proc/cpuinfo`` on each), and ``build_runner`` once for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.model_runner import native
from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner, cpu_flags, select_backend, select_dtype, select_kv_dtype
from services.model_runner.native import load_kernels
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from shared.errors import FailedPrecondition
from shared.sampling_params import SamplingParams

BASE = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
# Intel Xeon, Sapphire Rapids (the machine): AVX-512 with bf16 and AMX tiles.
AMX = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                        "amx_int8"})
# Intel Xeon, Emerald Rapids-class with its AMX not exposed (session 25's machine): AVX512-BF16 and
# AVX512-FP16 but no AMX flags; its cores run vdpbf16ps at half their fp32 FMA rate.
INTEL_NO_AMX = frozenset(AMX - {"amx_tile", "amx_bf16", "amx_int8"})
INTEL, AMD = "GenuineIntel", "AuthenticAMD"
# Intel Xeon, Skylake-SP / Cascade Lake: AVX-512 without bf16.
AVX512 = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
# AMD EPYC Zen 4: AVX-512 with bf16 dot products, no AMX.
ZEN4 = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
# AMD EPYC Zen 2/3 (this machine's class): AVX2 + FMA only.
EPYC_AVX2 = frozenset(BASE | {"sse4a", "clzero"})
LLAMA = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


@pytest.mark.parametrize(("flags", "bf16_kernels", "dtype", "reason_part"), [
    (AMX, True, "bfloat16", "(amx_bf16, avx512_bf16) and the native batch-invariant bf16 kernels"),
    (ZEN4, True, "bfloat16", "(avx512_bf16) and the native batch-invariant bf16 kernels"),
    # bf16 hardware without batch-invariant bf16 kernels (none built, or the build failed):
    # torch's bf16 GEMMs would let the cache change the answer, so fp32
    (AMX, False, "float32", "bf16 hardware (amx_bf16, avx512_bf16) but no batch-invariant bf16 kernels"),
    (ZEN4, False, "float32", "bf16 hardware (avx512_bf16) but no batch-invariant bf16 kernels"),
    (AVX512, True, "float32", "no AMX-BF16 or AVX512-BF16"),
    (AVX512, False, "float32", "no AMX-BF16 or AVX512-BF16"),
    (EPYC_AVX2, False, "float32", "no AMX-BF16 or AVX512-BF16"),
    (frozenset(), False, "float32", "no AMX-BF16 or AVX512-BF16"),
])  # fmt: skip
def test_auto_dtype_is_bf16_only_with_bf16_hardware_and_invariant_kernels(
        flags: frozenset[str], bf16_kernels: bool, dtype: str, reason_part: str) -> None:
    choice = select_dtype("auto", "cpu", flags, bf16_kernels=bf16_kernels)
    assert choice.value == dtype
    assert reason_part in choice.reason and choice.reason.startswith("auto: ")


@pytest.mark.parametrize(("flags", "vendor", "fma", "dtype"), [
    (INTEL_NO_AMX, INTEL, True, "bfloat16"),  # bf16 mode's arithmetic in fp32 FMAs: full rate
    (INTEL_NO_AMX, INTEL, False, "float32"),  # vdpbf16ps at half the fp32 FMA rate: fp32 is faster
    (INTEL_NO_AMX, AMD, False, "bfloat16"),  # the same flags from a vendor whose dot products are fast
    (INTEL_NO_AMX, "", False, "bfloat16"),  # vendor unknown: the flags decide, as before
    (AMX, INTEL, False, "bfloat16"),  # AMX tiles run the GEMMs
    (ZEN4, AMD, False, "bfloat16"),
    (ZEN4, INTEL, False, "float32"),
    (AVX512, INTEL, True, "float32"),  # no bf16 hardware at all
])  # fmt: skip
def test_auto_dtype_by_vendor(flags: frozenset[str], vendor: str, fma: bool, dtype: str) -> None:
    """bf16 mode only where it runs at full rate: an Intel core without AMX gets it in fp32 FMAs, or
    fp32 mode where its kernels would run bf16 dot products, with the reason."""
    choice = select_dtype("auto", "cpu", flags, bf16_kernels=True, vendor=vendor, bf16_fma=fma)
    assert choice.value == dtype
    if dtype == "float32" and flags != AVX512:
        assert choice.reason == ("auto: an Intel CPU with AVX512-BF16 but no AMX-BF16, and bf16 mode set to dot "
                                 "products (KVMESH_NATIVE_BF16=dots): its cores run vdpbf16ps at half their fp32 "
                                 "FMA rate, so float32 is the faster dtype here")
    # without the invariant kernels the Intel rule is not what decides (the flags' reason stays)
    assert "no batch-invariant bf16 kernels" in select_dtype("auto", "cpu", flags & INTEL_NO_AMX, vendor=INTEL).reason \
        or flags == AVX512
    # asked for explicitly, bf16 is given on any vendor
    assert select_dtype("bfloat16", "cpu", flags, vendor=vendor).value == "bfloat16"


@pytest.mark.parametrize(("setting", "flags", "vendor", "fma"), [
    ("auto", INTEL_NO_AMX, INTEL, True), ("auto", AMX, INTEL, False), ("auto", ZEN4, AMD, False),
    ("auto", INTEL_NO_AMX, AMD, False), ("auto", INTEL_NO_AMX, "", False),
    ("fma", ZEN4, AMD, True), ("dots", INTEL_NO_AMX, INTEL, False),
])  # fmt: skip
def test_bf16_in_fma_rule(setting: str, flags: frozenset[str], vendor: str, fma: bool) -> None:
    assert native.bf16_in_fma(flags, vendor, setting) is fma


def test_bf16_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="KVMESH_NATIVE_BF16 must be one of auto, fma, dots, not 'fast'"):
        native.bf16_in_fma(INTEL_NO_AMX, INTEL, "fast")


def test_cpu_vendor_reads_this_machine() -> None:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("vendor_id")), "vendor_id :")
    assert native.cpu_vendor() == line.partition(":")[2].strip()


def test_auto_dtype_defaults_to_no_bf16_kernels() -> None:
    assert select_dtype("auto", "cpu", ZEN4) == select_dtype("auto", "cpu", ZEN4, bf16_kernels=False)
    assert select_dtype("auto", "cpu", ZEN4).value == "float32"


def test_explicit_dtype_cuda_and_quantization_keep_float32_rules() -> None:
    assert select_dtype("float32", "cpu", AMX) == select_dtype("float32", "cpu", EPYC_AVX2)
    assert (select_dtype("float32", "cpu", AMX).value, select_dtype("float32", "cpu", AMX).reason) == (
        "float32", "set explicitly")
    assert select_dtype("bfloat16", "cpu", EPYC_AVX2).value == "bfloat16"  # asked for: given, if slow
    assert select_dtype("auto", "cuda", AMX).value == "float32"
    assert select_dtype("auto", "cuda", AMX, bf16_kernels=True).value == "float32"
    # quantization packs fp32 weights: bf16 would be refused by prepare_model
    assert select_dtype("auto", "cpu", AMX, quantization="int8", bf16_kernels=True).value == "float32"


@pytest.mark.parametrize(("flags", "built", "backend", "reason_part"), [
    (AMX, True, "cpu", "native CPU kernels"),  # no bf16 kernels given: fp32 on the native kernels
    (ZEN4, True, "cpu", "native CPU kernels"),
    (AVX512, True, "cpu", "native CPU kernels"),
    (EPYC_AVX2, True, "cpu", "native CPU kernels"),
    (EPYC_AVX2, False, "torch", "did not build"),  # no compiler, or the build failed
])  # fmt: skip
def test_auto_backend_per_machine(flags: frozenset[str], built: bool, backend: str, reason_part: str) -> None:
    dtype = select_dtype("auto", "cpu", flags).value
    choice = select_backend("auto", "cpu", dtype, built, **LLAMA)
    assert choice.value == backend and reason_part in choice.reason


def test_auto_backend_falls_back_for_shapes_the_native_decode_does_not_take() -> None:
    assert select_backend("auto", "cpu", "float32", True, num_heads=32, num_kv_heads=2, head_dim=64).value == "cpu"
    assert select_backend("auto", "cpu", "float32", True, num_heads=34, num_kv_heads=2, head_dim=64).value == "torch"
    assert select_backend("auto", "cpu", "float32", True, num_heads=4, num_kv_heads=2, head_dim=512).value == "torch"
    assert select_backend("auto", "cpu", "float16", True, **LLAMA).value == "torch"


@pytest.mark.parametrize(("bf16_kernels", "built", "backend", "reason_part"), [
    (True, True, "cpu", "bf16 GEMMs with fp32 accumulation, batch invariant"),
    (False, True, "torch", "no bf16 GEMM here"),  # bf16 asked for where the GEMM is not built
    (True, False, "torch", "did not build"),
])  # fmt: skip
def test_auto_backend_for_bf16(bf16_kernels: bool, built: bool, backend: str, reason_part: str) -> None:
    choice = select_backend("auto", "cpu", "bfloat16", built, **LLAMA, bf16_kernels=bf16_kernels)
    assert choice.value == backend and reason_part in choice.reason


def test_auto_picks_bf16_only_together_with_its_native_backend() -> None:
    """The pair auto resolves to on a bf16 CPU is (bfloat16, cpu) or (float32, cpu), never the
    torch path's non-invariant bf16 GEMMs."""
    for flags in (AMX, ZEN4):
        for kernels in (True, False):
            dtype = select_dtype("auto", "cpu", flags, bf16_kernels=kernels).value
            assert (dtype, select_backend("auto", "cpu", dtype, True, **LLAMA, bf16_kernels=kernels).value) == (
                "bfloat16" if kernels else "float32", "cpu")


def test_explicit_and_cuda_backends() -> None:
    assert select_backend("torch", "cpu", "float32", True, **LLAMA).value == "torch"
    assert select_backend("auto", "cuda", "float32", False, **LLAMA).value == "triton"
    forced = select_backend("cpu", "cpu", "float32", False, **LLAMA)
    assert forced.value == "cpu" and "torch path" in forced.reason


def test_cpu_flags_reads_this_machine() -> None:
    flags = cpu_flags()
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "flags :")
    assert flags == frozenset(line.partition(":")[2].split())


def _greedy(runner: object, prompt: list[int], steps: int) -> list[int]:
    new = NewRequestData("r", tuple(prompt), len(prompt), (1, 2, 3, 4), 0, len(prompt), SamplingParams())
    out = runner.execute(StepInput(0, new_requests=(new,)))  # type: ignore[attr-defined]
    tokens = [out.sampled[0].token_id]
    for i in range(1, steps):
        step = CachedRequestData("r", (), len(prompt) + i - 1, 1)
        tokens.append(runner.execute(StepInput(i, cached_requests=(step,))).sampled[0].token_id)  # type: ignore[attr-defined]
    return tokens


def test_build_runner_default_per_machine(tiny_llama_dir: Path) -> None:
    """The defaults, built for real: this machine's class (AVX2) gets fp32 on the native kernels
    where they build, and its output equals the torch fp32 reference; an AMX machine's flags give
    bf16 mode on the native kernels where their bf16 GEMM is built (a CPU with AVX512-BF16, as
    here on a Zen 4), fp32 elsewhere; an Intel CPU without AMX gets bf16 mode where this process's
    kernels run it in fp32 FMAs, else fp32 (its bf16 dot products run at half the fp32 rate); bf16 on
    the torch path stays available when asked for."""
    common = dict(model_dir=str(tiny_llama_dir), block_size=4, kv_cache_memory_bytes=16 * 2048, warmup=False)
    prompt = [5, 9, 17, 33, 65, 129, 7]
    runners = []
    try:
        default = build_runner(RunnerConfig(**common), flags=EPYC_AVX2)  # type: ignore[arg-type]
        runners.append(default)
        info = default.model_info()
        built = load_kernels() is not None
        assert (info.dtype, info.attention_backend) == ("float32", "cpu" if built else "torch")
        assert info.dtype_reason == "auto: the CPU has no AMX-BF16 or AVX512-BF16 (bf16 would run as converted fp32)"
        assert info.attention_backend_reason == (
            "auto: the native CPU kernels (built here, float32)" if built
            else "auto: the native kernels did not build here (no C compiler, or it failed)")
        reference = build_runner(RunnerConfig(**common, dtype="float32", attention_backend="torch"),  # type: ignore[arg-type]
                                 flags=EPYC_AVX2)
        runners.append(reference)
        assert reference.model_info().attention_backend == "torch"
        expected = _greedy(reference, prompt, 6)
        assert _greedy(default, prompt, 6) == expected

        amx = build_runner(RunnerConfig(**common), flags=AMX)  # type: ignore[arg-type]
        runners.append(amx)
        info = amx.model_info()
        kernels = load_kernels()
        if kernels is not None and kernels.linear_bf16 is not None:  # this CPU has AVX512-BF16: bf16 mode
            # bf16 mode keeps K/V in bf16: 1,024-byte blocks, twice the fp32 pool's 16 of the same budget
            assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == ("bfloat16", "bfloat16", "cpu")
            assert (default.pool.bytes_per_block, default.pool.num_blocks) == (2048, 16)
            assert (amx.pool.bytes_per_block, amx.pool.num_blocks, info.num_blocks) == (1024, 32, 32)
            fp32_kv = build_runner(RunnerConfig(**common, kv_cache_dtype="float32"), flags=AMX)  # type: ignore[arg-type]
            runners.append(fp32_kv)
            assert (fp32_kv.model_info().dtype, fp32_kv.model_info().kv_cache_dtype) == ("bfloat16", "float32")
            assert (fp32_kv.pool.bytes_per_block, fp32_kv.pool.num_blocks) == (2048, 16)
            assert "native batch-invariant bf16 kernels built here" in info.dtype_reason
            # which bf16 GEMM this process runs (one for every m: their bits differ) is in GetModelInfo too
            assert info.dtype_reason.endswith(
                "; bf16 GEMMs on AMX tiles (native/gemm_amx.c)" if kernels.linear_bf16_amx
                else "; bf16 weights and KV widened into fp32 FMAs, activations unrounded (native/gemm_bf16.c, fma)"
                if kernels.linear_bf16_fma else "; bf16 GEMMs on AVX512-BF16 (native/gemm_bf16.c)")
            assert "bf16 GEMMs with fp32 accumulation" in info.attention_backend_reason
            # head_dim 16: the bf16 dot products take multiples of 32 (tests/integration/test_default_mode.py's
            # head_dim-32 twin says the other)
            assert info.attention_backend_reason.endswith("; a bf16 pool attended in fp32 (K/V widened)")
            assert amx.model.model.layers[0].self_attn.qkv_proj.packed.mode == "native_bf16"  # type: ignore[union-attr]
            assert amx.model.model.norm.weight.dtype == torch.float32  # norms, residual stream: fp32
        else:  # no bf16 GEMM here, whatever the flags say: fp32
            assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == (
                "float32", "float32", "cpu" if built else "torch")
            assert "no batch-invariant bf16 kernels" in info.dtype_reason
        intel = build_runner(RunnerConfig(**common), flags=INTEL_NO_AMX, vendor=INTEL)  # type: ignore[arg-type]
        runners.append(intel)
        info = intel.model_info()
        if kernels is not None and kernels.linear_bf16_fma:  # this process's kernels run bf16 in fp32 FMAs
            assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == ("bfloat16", "bfloat16", "cpu")
            assert info.dtype_reason.endswith("; bf16 weights and KV widened into fp32 FMAs, activations unrounded "
                                              "(native/gemm_bf16.c, fma)")
            assert info.attention_backend_reason.endswith("; a bf16 pool attended in fp32 (K/V widened)")
        else:  # vdpbf16ps (half rate on that CPU) or no bf16 GEMM: fp32
            assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == ("float32", "float32", "cpu" if built
                                                                                  else "torch")
            assert (intel.pool.bytes_per_block, intel.pool.num_blocks) == (2048, 16)
            assert _greedy(intel, prompt, 6) == expected
        torch_bf16 = build_runner(RunnerConfig(**common, dtype="bfloat16", attention_backend="torch"),  # type: ignore[arg-type]
                                  flags=AMX)
        runners.append(torch_bf16)
        info = torch_bf16.model_info()
        assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == ("bfloat16", "bfloat16", "torch")
        assert torch_bf16.model.model.norm.weight.dtype == torch.bfloat16
        assert all(0 <= t < info.vocab_size for t in _greedy(torch_bf16, prompt, 3))
    finally:
        for r in runners:
            r.pool.close()


def test_batch_invariant_plan_makes_every_row_a_decode_of_its_position() -> None:
    """A step of one 3-row prefill chunk after 5 cached tokens and one decode: the invariant plan
    has one decode entry per row (context 6, 7, 8 and the decode's 4) and no chunk; the default
    plan keeps the chunk for the prefill kernel and the one decode. The one-call stack takes
    both; a step with a row in neither (a padding row) it does not."""
    from services.model_runner.attention.base import AttentionMetadata
    from services.model_runner.attention.cpu_backend import CpuAttentionBackend

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([21, 22, 23, 40], dtype=torch.int64),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([8, 4], dtype=torch.int32),
        block_tables=torch.tensor([[4, 5], [10, 0]], dtype=torch.int32),
        max_query_len=3, max_seq_len=8,
    )  # fmt: skip
    invariant = CpuAttentionBackend(batch_invariant=True)
    if invariant.native_kernels is None:
        pytest.skip("the native kernels did not build here")
    plan = invariant.stack_plan(meta, 4, 4)
    assert plan is not None and not plan.chunks and plan.max_len == 8
    assert plan.rows.tolist() == [0, 1, 2, 3] and plan.seq_lens.tolist() == [6, 7, 8, 4]
    assert plan.tables.tolist() == [[4, 5], [4, 5], [4, 5], [10, 0]]
    default = CpuAttentionBackend().stack_plan(meta, 4, 4)
    assert default is not None and default.rows.tolist() == [3] and default.seq_lens.tolist() == [4]
    assert [(c.start, c.end, c.seq_len, c.first_block) for c in default.chunks] == [(0, 3, 8, 0)]
    assert [table.tolist() for table in default.chunk_tables] == [[4, 5]]
    assert invariant.stack_plan(meta, 4, 5) is None and CpuAttentionBackend().stack_plan(meta, 4, 5) is None


def test_batch_invariant_without_the_native_kernels_is_refused(tiny_llama_dir: Path) -> None:
    config = RunnerConfig(model_dir=str(tiny_llama_dir), attention_backend="torch", batch_invariant=True,
                          kv_cache_memory_bytes=16 * 2048, block_size=4, warmup=False)
    with pytest.raises(ValueError, match="batch_invariant needs the native CPU kernels on float32 weights "
                                         r"\(fp32 or bf16 mode\); here: dtype float32, attention backend torch"):
        build_runner(config, flags=EPYC_AVX2)


def test_auto_kv_dtype_is_bf16_in_native_bf16_mode_only() -> None:
    """bf16 mode on the native kernels: a bf16 pool; anything else: the model's dtype (fp32 mode
    keeps fp32, the exact mode); an explicit float32 / bfloat16 is kept, and off the CPU only where
    it is the model's dtype (only the CPU backends convert)."""
    bf16 = select_kv_dtype("auto", torch.float32, native_bf16=True, device_type="cpu")
    assert bf16.value == "bfloat16" and bf16.reason.startswith("auto: bf16 mode keeps K/V in bf16")
    assert select_kv_dtype("auto", torch.float32, native_bf16=False, device_type="cpu").value == "float32"
    assert select_kv_dtype("auto", torch.bfloat16, native_bf16=False, device_type="cpu").value == "bfloat16"
    assert select_kv_dtype("float32", torch.float32, native_bf16=True, device_type="cpu").value == "float32"
    assert select_kv_dtype("bfloat16", torch.float32, native_bf16=False, device_type="cpu").value == "bfloat16"
    assert select_kv_dtype("int4", torch.float32, native_bf16=True, device_type="cpu").value == "int4"
    assert select_kv_dtype("bfloat16", torch.bfloat16, native_bf16=False, device_type="cuda").value == "bfloat16"
    with pytest.raises(FailedPrecondition, match="kv_cache_dtype=bfloat16 with float32 weights runs on the CPU only"):
        select_kv_dtype("bfloat16", torch.float32, native_bf16=False, device_type="cuda")


def test_kv_cache_dtype_values() -> None:
    for value in ("auto", "float32", "bfloat16", "fp8_e4m3", "int4"):
        assert RunnerConfig(kv_cache_dtype=value).kv_cache_dtype == value
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, fp8_e4m3, int4"):
        RunnerConfig(kv_cache_dtype="float16")
