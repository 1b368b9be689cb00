"""The model-runner's frozen configuration (read from ``KVMESH_RUNNER_*`` in main.py only)."""

from __future__ import annotations

from dataclasses import dataclass

from services.model_runner.cpu_bind import check_setting as check_cpu_bind

# RunnerConfig.quantization's values (model/packed.py packs for each)
QUANTIZATIONS = ("auto", "none", "int8", "fp16", "int8_weight_only", "q4_1")
WEIGHT_ONLY = ("int8_weight_only", "q4_1")  # packed once from fp32 weights for a native GEMM of their own
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "int4")


@dataclass(frozen=True)
class RunnerConfig:
    """What to load and how big the KV pool is.

    Attributes:
        model_dir: local folder with ``config.json`` and ``*.safetensors``.
        model_id: identity reported to the others (enters the prefix-hash seed); default: folder name.
        dtype: weights dtype: ``auto`` (bf16 mode on a CPU with AVX512-BF16 where the native
            kernels build, float32 elsewhere; ``factory.select_dtype``), ``float32`` (the exact
            reference mode the parity tests pin), ``float16`` or ``bfloat16``. ``bfloat16`` on
            the native kernels is bf16 mode (bf16 GEMMs with fp32 accumulation, fp32 everything
            else, batch invariant; docs/model_runner.md, "bf16 mode"), on ``torch`` torch's bf16.
        kv_cache_dtype: ``auto`` (bf16 in bf16 mode on the native kernels, else the weights dtype;
            ``factory.select_kv_dtype``), ``float32`` or ``bfloat16`` (explicitly: bf16 mode with
            an fp32 pool, as before bf16 KV, or fp32 weights over a bf16 pool; the CPU only where
            it is not the weights dtype), ``fp8_e4m3`` or ``int4`` (per-token, per-head groups of
            32 channels with float16 scales stored in the block; docs/kv_quantization.md). Only
            ``auto`` with fp32 weights is a parity mode with fp32's outputs.
        kv_cache_hadamard: ``int4`` only: rotate K and V by a block-diagonal Hadamard matrix before
            quantizing (and Q and the attention output to match), which spreads outlier channels.
        block_size: tokens per KV block.
        kv_cache_memory_bytes: budget of the KV pool; ``num_blocks = budget // bytes_per_block``.
        max_model_len: longest sequence; 0 = the model's ``max_position_embeddings``.
        attention_backend: ``auto`` (triton on CUDA; on the CPU ``cpu`` where the native kernels
            build and take the model, fp32 or bf16 mode, else ``torch``; ``factory.select_backend``),
            ``torch`` (the reference), ``triton`` or ``cpu`` (the native C kernels; fp32 or bf16
            mode, CPU).
        device: ``auto``, ``cpu`` or ``cuda[:N]``.
        num_threads: the compute thread's team on CPU (its OpenMP and torch intra-op threads,
            which the native kernels use too); 0 keeps the default, one per CPU.
        cpu_bind: where the compute threads run (cpu_bind.py): ``auto`` (one thread bound to each
            CPU this process may use when the team takes them all, else unbound; ``kvmesh up``
            gives a smaller team the last CPUs and its other services the rest), ``none``, or a
            CPU list such as ``3`` or ``0-3`` (one thread per CPU listed, in order).
        warmup: run a dummy step at start.
        quantization: ``auto`` (default: ``q4_1`` where the runner computes in float32 on the native
            kernels and every loaded weight already lies on its grid, checked at load — lossless
            there, so bitwise float32 mode at a fifth of the weight bytes; ``none`` otherwise;
            ``factory.select_quantization``), ``none`` (fp32 as loaded), or, CPU + fp32 only, ``int8`` (int8
            weights, dynamically quantized activations), ``fp16`` (fp16 weights, fp32 math) or
            ``int8_weight_only`` (int8 weights, one scale per output channel, on the native
            kernels' int8 GEMM: bf16 GEMM inputs, fp32 accumulation and everything else, batch
            invariant; needs a CPU with AVX512-BF16) or ``q4_1`` (llama.cpp's Q4_1 groups for the
            projections, Q8_0 for the head, on the native kernels' fp32 GEMM over the
            dequantized weights: a fifth of the weight bytes, any x86 CPU; bitwise fp32 mode on
            a checkpoint already on that grid, such as the embedded SmolLM2). Faster linear
            layers, but outputs are in general no longer token-identical to fp32 (see
            docs/model_runner.md).
        pack_tied_head: give a head tied to the embedding its own packed copy (fp32 on the CPU):
            a third faster vocabulary projection for ``vocab x hidden x 4`` more bytes
            (113 MB for SmolLM2-135M); off keeps one copy of the weight.
        screen_head: greedy rows score the vocabulary in cheaper arithmetic first and compute
            logits only for the columns that could be their maximum (``model/head_screen.py``):
            the same tokens, bit for bit. fp32 mode on the native kernels scores in bf16 where the
            bf16 GEMM runs ``vdpbf16ps`` or AMX (a bf16 copy of the head, ``vocab x hidden x 2``
            bytes); bf16 mode in int8 groups where the CPU has AVX512-VNNI (``vocab x hidden``
            bytes and two floats per 32 weights). Off: every column's logit.
        batch_invariant: every query row attended as a decode of its own position on the native
            kernels (needs them: fp32 or bf16 mode on the CPU, built): chunked prefill, prefix-cache hits and
            preemption then give bitwise a cold run's numbers, not only its greedy tokens, and
            every step runs the one-call native stack; prefill attention is slower (see
            docs/model_runner.md, "auto").
        streaming_sinks, streaming_window: attention-sinks mode (StreamingLLM) for endless streams,
            server-wide and opt-in: each request keeps its first ``streaming_sinks`` tokens and
            its last ``streaming_window`` tokens of KV, the middle blocks go back to the pool, and
            positions are those within the cache (docs/kv_layout.md, "Attention sinks
            (StreamingLLM)"). It CHANGES OUTPUTS once a sequence passes ``sinks + window``
            tokens: not a parity mode. Both set (> 0) or neither (0); torch attention only,
            models whose layers all use full attention, ``sinks + window <=
            max_position_embeddings``; ``max_model_len`` is then unbounded by the model.
    """

    model_dir: str = ""
    model_id: str = ""
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_hadamard: bool = False
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 << 20
    max_model_len: int = 0
    attention_backend: str = "auto"
    device: str = "auto"
    num_threads: int = 0
    cpu_bind: str = "auto"
    warmup: bool = True
    quantization: str = "auto"
    pack_tied_head: bool = True
    screen_head: bool = True
    batch_invariant: bool = False
    streaming_sinks: int = 0
    streaming_window: int = 0

    def __post_init__(self) -> None:
        check_cpu_bind(self.cpu_bind, self.num_threads)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization in WEIGHT_ONLY and (self.dtype not in ("auto", "float32")
                                                 or self.attention_backend not in ("auto", "cpu")):
            raise ValueError(f"quantization={self.quantization} runs on the native CPU kernels from float32 weights: "
                             f"dtype must be auto or float32 (got {self.dtype!r}) and attention_backend auto "
                             f"or cpu (got {self.attention_backend!r})")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ValueError(f"attention_backend must be auto, torch, triton or cpu, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_hadamard and self.kv_cache_dtype != "int4":
            raise ValueError("kv_cache_hadamard needs kv_cache_dtype int4")
        if self.streaming_sinks < 0 or self.streaming_window < 0 or (self.streaming_sinks > 0) != (
            self.streaming_window > 0
        ):
            raise ValueError(f"streaming_sinks and streaming_window must both be > 0 (attention sinks) or both 0, "
                             f"got {self.streaming_sinks} and {self.streaming_window}")

    @property
    def streaming(self) -> bool:
        """Whether attention-sinks mode is on."""
        return self.streaming_sinks > 0
