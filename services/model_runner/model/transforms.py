"""What the runner does to a loaded model before serving it: pack the weights, pick the backend.

Both are transforms applied from outside (gpt-fast's quantize / tensor-parallel style): the
layers stay plain torch, and a backend is a function of the model, not a flag in every layer.
"""

from __future__ import annotations

import torch

from services.model_runner.config import QUANTIZATIONS
from services.model_runner.model.head_screen import make_screen, screens
from services.model_runner.model.huge_pages import HoldsPacked, move_to_huge_pages
from services.model_runner.model.layers import Linear
from services.model_runner.model.native_layers import use_native_kernels
from services.model_runner.model.packed import (
    NATIVE_MODES,
    PackedWeight,
    dequantize_groups,
    quantize_q4_1,
    quantize_q8_0,
)
from services.model_runner.model.transformer import CausalLM
from services.model_runner.native import NativeKernels


def prepare_model(
    model: CausalLM, quantization: str = "none", pack_tied_head: bool = True, kernels: NativeKernels | None = None,
    gemm_dtype: str = "float32", screen_head: bool = True,
) -> None:
    """Packs the loaded weights for the CPU kernels of ``quantization`` (see ``model/packed.py``).

    ``none`` packs fp32 weights for oneDNN when they are fp32 on the CPU and does nothing
    otherwise. A tied head gets a packed copy of the embedding (which stays dense for the
    lookups) under ``fp16``/``int8``, and under ``none`` when ``pack_tied_head``: the vocabulary
    projection is the largest GEMM of a decode step (bitwise the same logits packed or not; the
    time saved and the memory it costs are in docs/model_runner.md). With ``kernels`` (the
    attention backend's native build), the norms, the rotary embedding and SwiGLU run on them
    (:func:`~services.model_runner.model.native_layers.use_native_kernels`), and under ``none``
    the fp32 weights are packed for their GEMM (``gemm.c``) instead of oneDNN's. Call it once,
    after loading; a second call with the same ``quantization`` does nothing.

    ``gemm_dtype="bfloat16"`` (with ``kernels`` that have the bf16 GEMM, ``quantization`` none,
    fp32 weights as loaded) is bf16 mode: every linear weight and the tied head are packed once
    to bf16 for ``gemm_bf16.c`` (activations rounded to bf16 at each GEMM input, fp32
    accumulation in a fixed order per row); the residual stream, norms, rotary, attention and
    the KV cache stay fp32 (docs/model_runner.md, "bf16 mode").

    ``int8_weight_only`` (with ``kernels`` that have the int8 GEMM, fp32 weights as loaded)
    packs every linear weight and the tied head as int8 with one scale per output channel for
    ``gemm_int8.c``; the GEMMs are then bf16 mode's with the weights widened in registers
    (activations rounded to bf16 at the input, fp32 accumulation), everything else stays fp32
    (docs/model_runner.md, "Weight-only int8"). The embedding stays fp32 for the lookups.

    ``q4_1`` (with ``kernels``, fp32 weights as loaded) packs every projection in llama.cpp's Q4_1
    groups and the head (tied or not) in Q8_0 for ``gemm_q4_1.c``, whose GEMMs are fp32 over the
    dequantized weights (docs/model_runner.md, "Weight-only Q4_1"); everything else is fp32 mode.

    ``screen_head`` gives the packed head a cheaper copy that screens greedy decoding's columns
    (``model/head_screen.py``): int8 codes where the CPU has AVX512-VNNI (in bf16 mode beside its
    bf16 GEMM; in fp32 mode unless the bf16 GEMM runs on AMX), else in fp32 mode a bf16 copy where
    the bf16 GEMM runs ``vdpbf16ps`` or AMX. The same tokens, most of the vocabulary's logits never
    computed.

    Raises:
        ValueError: an unknown ``quantization``, another one than the model was prepared
            for, or ``fp16``/``int8`` on weights that are not fp32 on the CPU; ``bfloat16``
            without the native bf16 GEMM, or with a quantization; ``int8_weight_only``
            without the native int8 GEMM; ``q4_1`` without the native kernels.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if model.prepared is not None:
        if model.prepared != quantization:
            raise ValueError(f"the model is already prepared for quantization {model.prepared!r}")
        return
    if gemm_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"gemm_dtype must be float32 or bfloat16, got {gemm_dtype!r}")
    bf16 = gemm_dtype == "bfloat16"
    if bf16 and (quantization != "none" or kernels is None or kernels.linear_bf16 is None):
        raise ValueError("bf16 mode needs the native bf16 GEMM (a CPU with AVX512-BF16) and quantization none")
    if quantization == "int8_weight_only" and (kernels is None or kernels.linear_int8 is None):
        raise ValueError("int8_weight_only needs the native int8 GEMM (the native CPU kernels on a CPU with "
                         "AVX512-BF16)")
    if quantization == "q4_1" and kernels is None:
        raise ValueError("q4_1 needs the native CPU kernels (gemm_q4_1.c)")
    if quantization == "int8_weight_only":
        mode = "native_int8"
    elif quantization == "q4_1":
        mode = "native_q4_1"
    elif quantization != "none":
        mode = quantization
    else:
        mode = "native_bf16" if bf16 else "native" if kernels is not None else "fp32"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    embedding = model.model.embed_tokens.weight
    # before packing frees an untied head's dense weight; a tied head's survivors come from the embedding
    head_weight = model.lm_head.weight if model.lm_head is not None else embedding
    screen = None
    if screen_head and kernels is not None and screens(head_weight, kernels, _head_mode(mode)):
        tied = model.lm_head is None and embedding.is_contiguous()
        screen = make_screen(head_weight, kernels, _head_mode(mode), dense=embedding.data if tied else None)
    if quantization != "none" or bf16 or all(PackedWeight.supported(m.weight, mode) for m in linears):
        for module in linears:
            module.pack(_head_mode(mode) if module is model.lm_head else mode, kernels)
    # NOTE: bf16 mode always packs a tied head: the logits' GEMM is then bf16 like every other;
    # int8_weight_only quantizes it too: it is a fifth of a small model's weight bytes per token
    pack_head = quantization != "none" or bf16 or (pack_tied_head and PackedWeight.supported(embedding, mode))
    if model.lm_head is None and pack_head:
        model.packed_head = PackedWeight(embedding, None, _head_mode(mode), kernels)
    head = model.head_packing
    if head is not None and head.mode in ("native", "native_bf16"):
        head.screen = screen
    else:
        screen = None
    if kernels is not None:
        # before use_native_kernels: the decode stack takes the weights' addresses
        packs = [m.packed for m in linears] + [model.packed_head]
        owners: list[HoldsPacked] = [p for p in packs if p is not None and p.mode in NATIVE_MODES]
        move_to_huge_pages(owners + ([screen] if screen is not None else []))
        use_native_kernels(model, kernels)
    model.prepared = quantization
    model.compute_dtype = "bfloat16" if bf16 else {"native_int8": "int8", "native_q4_1": "q4_1"}.get(mode)


def _head_mode(mode: str) -> str:
    """The head's packing under ``mode``: Q8_0 beside Q4_1 projections, as llama.cpp's Q4_1 files of
    small models store it (the logits are the most sensitive GEMM), else the projections' own."""
    return "native_q8_0" if mode == "native_q4_1" else mode


def on_q4_1_grid(model: CausalLM, group: int) -> bool:
    """Whether ``quantization=q4_1`` would hold this loaded fp32 model exactly: every projection's
    weights are Q4_1 values and the head's (the embedding, when tied) Q8_0 values, bit for bit
    (quantized and dequantized again, they come back unchanged). A checkpoint dequantized from a
    llama.cpp Q4_1 file is; one trained in fp32 / bf16 is not, and fails on its first projection.
    Cost: one quantization of every weight (the check stops at the first one off the grid)."""
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    weights = [m.weight for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    if not weights or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in (*weights, head)):
        return False
    with torch.no_grad():
        for w in weights:
            if not torch.equal(dequantize_groups(*quantize_q4_1(w, group), group), w):
                return False
        return bool(torch.equal(dequantize_groups(*quantize_q8_0(head, group), group), head))
