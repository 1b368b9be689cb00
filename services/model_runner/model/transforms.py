"""What the runner does to a loaded model before serving it: pack the weights, pick the backend.

Both are transforms applied from outside (gpt-fast's quantize / tensor-parallel style): the
layers stay plain torch, and a backend is a function of the model, not a flag in every layer.
"""

from __future__ import annotations

from services.model_runner.model.layers import Linear
from services.model_runner.model.native_layers import use_native_kernels
from services.model_runner.model.packed import QUANTIZATIONS, PackedWeight
from services.model_runner.model.transformer import CausalLM
from services.model_runner.native import NativeKernels


def prepare_model(
    model: CausalLM, quantization: str = "none", pack_tied_head: bool = True, kernels: NativeKernels | None = None
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

    Raises:
        ValueError: an unknown ``quantization``, another one than the model was prepared
            for, or ``fp16``/``int8`` on weights that are not fp32 on the CPU.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if model.prepared is not None:
        if model.prepared != quantization:
            raise ValueError(f"the model is already prepared for quantization {model.prepared!r}")
        return
    mode = quantization if quantization != "none" else "native" if kernels is not None else "fp32"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if quantization != "none" or all(PackedWeight.supported(m.weight, mode) for m in linears):
        for module in linears:
            module.pack(mode, kernels)
    embedding = model.model.embed_tokens.weight
    pack_head = quantization != "none" or (pack_tied_head and PackedWeight.supported(embedding, mode))
    if model.lm_head is None and pack_head:
        model.packed_head = PackedWeight(embedding, None, mode, kernels)
    if kernels is not None:
        use_native_kernels(model, kernels)
    model.prepared = quantization
