"""The native CPU backend applied to a loaded model from outside (gpt-fast style).

:func:`use_native_kernels` swaps the model's elementwise ops for subclasses that call the native
kernels (``services/model_runner/native``) and, when every layer is one ``decode_stack.c`` can
run, the decoder for :class:`NativeDecoderModel`, which runs a step's whole layer stack (decode
rows and prefill chunks) in one call. The plain layers in ``layers.py`` and ``transformer.py`` know nothing of it.

Each native op keeps its plain parent's result exactly (the fused norm and SwiGLU to fp32
rounding, the rotary bitwise; the tests check each against torch) and falls back to the parent
for anything its kernel does not take (another dtype or device, a strided view).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.model_runner.model.context import ForwardContext
from services.model_runner.model.layers import MLP, ApplyRotary, RMSNorm, SiluAndMul
from services.model_runner.model.native_stack import STACK_MODES, NativeDecodeStack, StackLayer, StackShape
from services.model_runner.model.transformer import CausalLM, DecoderLayer, DecoderModel
from services.model_runner.native import NativeKernels, is_cpu_fp32


class NativeRMSNorm(RMSNorm):
    """:class:`RMSNorm` with the residual add and the norm in one native pass (fp32, CPU)."""

    def __init__(self, norm: RMSNorm, kernels: NativeKernels):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight  # the loaded parameter itself, not a copy
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self._takes(x):
            return self._native(x, None)
        return super().forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._takes(x) and residual.is_contiguous() and is_cpu_fp32(residual):
            return self._native(x, residual), residual
        return super().add_forward(x, residual)

    def _takes(self, x: torch.Tensor) -> bool:
        return is_cpu_fp32(x) and is_cpu_fp32(self.weight) and x.dim() == 2 and x.stride(1) == 1

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32)
        self.kernels.add_rms_norm(
            None if residual is None else residual.data_ptr(), x.data_ptr(), x.stride(0), self.weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], self.eps,
        )  # fmt: skip
        return out


class NativeRotary(ApplyRotary):
    """:class:`ApplyRotary` in one native pass (bitwise the torch formula)."""

    def __init__(self, kernels: NativeKernels):
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, heads, D]
        if not (is_cpu_fp32(x) and is_cpu_fp32(cos) and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and cos.is_contiguous() and sin.is_contiguous()):  # fmt: skip
            return super().forward(x, cos, sin)
        out = torch.empty(x.shape, dtype=torch.float32)
        self.kernels.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.shape[-1], out.data_ptr(),
                          x.shape[0], x.shape[1], x.shape[2])  # fmt: skip
        return out


class NativeSiluAndMul(SiluAndMul):
    """:class:`SiluAndMul` in one native pass."""

    def __init__(self, kernels: NativeKernels):
        super().__init__()
        self.kernels = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if not (is_cpu_fp32(gate_up) and gate_up.stride(1) == 1):
            return super().forward(gate_up)
        act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)
        self.kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), act.shape[0], act.shape[1])
        return act


class NativeMLP(MLP):
    """:class:`MLP` whose prefill chunks run the gate_up GEMM with SwiGLU in its epilogue
    (``kvmesh_linear_bf16_swiglu`` in bf16 mode, ``kvmesh_linear_f32_swiglu`` in fp32): the
    ``[T, 2I]`` projection is never written out and read back. Bitwise the unfused path (same tile,
    same SwiGLU code), so only speed differs. Chunks of decode size keep the unfused path here. It
    serves the per-layer path (a step the one-call stack declines); ``decode_stack.c`` fuses from 17
    rows in bf16 mode, 33 in fp32 (docs/model_runner.md, "The decode stack's gate_up with SwiGLU
    fused", "fp32 gate_up with SwiGLU fused")."""

    FUSED_MIN_ROWS = 33  # more rows than the GEMM's decode-sized chunks (4 row tiles of 8)

    def __init__(self, mlp: MLP, kernels: NativeKernels):
        # NOTE: nn.Module's init, not MLP's: the children are the loaded model's own.
        nn.Module.__init__(self)
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj, self.act_fn = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn
        self.fused = _fused_swiglu(mlp, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        packed = self.gate_up_proj.packed
        if (self.fused is None or packed is None or x.dim() != 2 or x.shape[0] < self.FUSED_MIN_ROWS
                or not is_cpu_fp32(x) or x.stride(1) != 1):  # fmt: skip
            return super().forward(x)
        weight = packed.packed
        assert isinstance(weight, torch.Tensor)
        act = torch.empty(x.shape[0], self.intermediate_size, dtype=torch.float32)
        status = self.fused(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), self.intermediate_size,
            None if packed.bias is None else packed.bias.data_ptr(), act.data_ptr(), act.stride(0),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native fused gate_up + SwiGLU failed with status {status}")
        return self.down_proj(act)


class NativeDecoderModel(DecoderModel):
    """:class:`DecoderModel` whose steps run the layer stack in one native call where the stack takes them."""

    def __init__(self, model: DecoderModel, stack: NativeDecodeStack):
        # NOTE: nn.Module's init, not DecoderModel's: the children are the loaded model's own
        # (same parameters, same names), not a second model built from the config.
        nn.Module.__init__(self)
        self.embed_tokens, self.layers = model.embed_tokens, model.layers
        self.norm, self.rotary = model.norm, model.rotary
        self.stack = stack

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        done = self.stack.run(x, cos, sin, ctx)
        return done if done is not None else super().run_layers(x, cos, sin, ctx)


def use_native_kernels(model: CausalLM, kernels: NativeKernels) -> None:
    """Prepares ``model`` for the native backend, in place; call after the weights are packed.

    The norms, the rotary embedding and SwiGLU run on the kernels (for prefill chunks, SwiGLU in the
    gate_up GEMM: :class:`NativeMLP`); the decoder becomes a
    :class:`NativeDecoderModel` when :func:`decode_stack` can describe every layer. Calling it
    again changes nothing.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                setattr(parent, name, NativeRMSNorm(child, kernels))
            elif type(child) is ApplyRotary:
                setattr(parent, name, NativeRotary(kernels))
            elif type(child) is SiluAndMul:
                setattr(parent, name, NativeSiluAndMul(kernels))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is MLP and _fused_swiglu(child, kernels) is not None:
                setattr(parent, name, NativeMLP(child, kernels))
    if type(model.model) is DecoderModel:
        stack = decode_stack(model.model, kernels)
        if stack is not None:
            model.model = NativeDecoderModel(model.model, stack)


def _fused_swiglu(mlp: MLP, kernels: NativeKernels) -> Any | None:
    """The fused gate_up + SwiGLU kernel for ``mlp``'s packing (fp32 or bf16 mode), or None: another
    packing, or an intermediate size of part weight panels (the gate and up panels must pair up one
    to one)."""
    packed = mlp.gate_up_proj.packed
    if packed is None or mlp.intermediate_size % kernels.panel_width:
        return None
    return {"native": kernels.linear_f32_swiglu, "native_bf16": kernels.linear_bf16_swiglu}.get(packed.mode)


def decode_stack(model: DecoderModel, kernels: NativeKernels) -> NativeDecodeStack | None:
    """The one-call stack of ``model``'s layers, or None unless every layer is one the C code runs:
    all projections packed for one GEMM (``gemm.c``, ``gemm_bf16.c`` or ``gemm_int8.c``), fp32
    norms with one eps, the same shapes in every layer."""
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    if not layers or len(layers) != len(model.layers):
        return None
    first = layers[0]
    attn, eps = first.self_attn, first.input_layernorm.eps
    packed_mode = first.self_attn.qkv_proj.packed.mode if first.self_attn.qkv_proj.packed is not None else None
    if packed_mode not in STACK_MODES:
        return None
    shape = StackShape(
        hidden=first.input_layernorm.weight.shape[0], num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, intermediate=first.mlp.intermediate_size, eps=eps, scale=attn.scale,
        mode=packed_mode,
    )  # fmt: skip
    described: list[StackLayer] = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if a.q_norm is not None:
            return None  # Qwen3's per-head q/k norms are not in decode_stack.c
        packed = [x.packed for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
        native = [w for w in packed if w is not None and w.mode == packed_mode]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if len(native) != len(packed):
            return None
        if not all(is_cpu_fp32(n.weight) and n.eps == eps for n in norms):
            return None
        if (a.q_size, a.kv_size, m.intermediate_size) != (attn.q_size, attn.kv_size, first.mlp.intermediate_size):
            return None
        qkv, o, gate_up, down = native
        described.append(StackLayer(norms[0].weight, norms[1].weight, qkv, o, gate_up, down))
    return NativeDecodeStack(described, shape, kernels)

