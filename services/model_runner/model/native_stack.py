"""The decoder-layer stack of a decode-only step in one native call (``native/decode_stack.c``).

With the native CPU kernels on, a SmolLM2 batch-32 decode step spent ~10% of its time in the
Python between kernels (module calls, checks, allocations, a ctypes call per kernel), on one
thread while the other waited. For steps whose every row is a decode, :meth:`NativeDecodeStack.run`
hands the whole stack to C, which calls the same kernels in the same order on the same arguments:
the hidden states are bitwise the per-layer path's. Anything else (a prefill chunk, padding rows,
fp8 calibration, another backend) returns None and the caller runs the layers in Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.packed import PackedWeight, is_cpu_fp32
from services.model_runner.native import NativeKernels

if TYPE_CHECKING:
    from services.model_runner.model.layers import Linear
    from services.model_runner.model.transformer import DecoderLayer, DecoderModel

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Layer(ctypes.Structure):
    """``KvmLayer``: norm weights, packed projections and biases, the layer's K/V caches."""

    _fields_ = [(name, _P) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
        "down_bias", "k_cache", "v_cache",
    )]  # fmt: skip


class _Shape(ctypes.Structure):
    """``KvmStackShape``."""

    _fields_ = [
        *((name, _I64) for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "block_size", "block_stride",
            "num_slots",
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    """``KvmDecodeStep``."""

    _fields_ = [
        ("tokens", _I64), ("cos", _P), ("sin", _P), ("slots", _P), ("tables", _P), ("seq_lens", _P), ("rows", _P),
        ("table_stride", _I64), ("max_seq_len", _I64), ("x", _P), ("residual", _P),
        *((name, _P) for name in ("h", "qkv", "qk", "attn", "gate_up", "act")),
    ]  # fmt: skip


class NativeDecodeStack:
    """Runs :class:`DecoderModel`'s layers for decode-only steps in ``kvmesh_decode_stack_f32``.

    Build it with :meth:`build` after the weights are packed (``CausalLM.prepare``).
    """

    def __init__(self, layers: Sequence[DecoderLayer], kernels: NativeKernels):
        self._num_layers = len(layers)
        self._fn = kernels.decode_stack
        first = layers[0]
        attn = first.self_attn
        self._q_size, self._kv_size = attn.q_size, attn.kv_size
        self._intermediate = first.mlp.intermediate_size
        self._hidden = first.input_layernorm.weight.shape[0]
        self._head_dim, self._num_heads, self._num_kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
        self._scale = attn.scale
        self._eps = first.input_layernorm.eps
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            entry = self._layers[i]
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv, entry.qkv_bias = _packed(a.qkv_proj)
            entry.o, entry.o_bias = _packed(a.o_proj)
            entry.gate_up, entry.gate_up_bias = _packed(m.gate_up_proj)
            entry.down, entry.down_bias = _packed(m.down_proj)
        self._cache_key: tuple[int, tuple[int, ...]] = (0, ())  # the pool self._layers points into
        self._shape = _Shape()

    @classmethod
    def build(cls, model: DecoderModel, kernels: NativeKernels) -> NativeDecodeStack | None:
        """The stack, or None unless every layer is one the C code runs: all projections packed
        for ``gemm.c``, fp32 norms with one eps, the same shapes in every layer."""
        layers = cast("list[DecoderLayer]", list(model.layers))
        if not layers:
            return None
        first = layers[0]
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if not all(isinstance(x.packed, PackedWeight) and x.packed.mode == "native" for x in linears):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(is_cpu_fp32(n.weight) and n.eps == first.input_layernorm.eps for n in norms):
                return None
            if (a.q_size, a.kv_size, m.intermediate_size) != (
                first.self_attn.q_size, first.self_attn.kv_size, first.mlp.intermediate_size
            ):
                return None
        return cls(layers, kernels)

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(last layer's MLP output, residual)`` for the embeddings ``x`` ``[T, hidden]``, or
        None when this step is not one the stack runs (the caller then runs the layers)."""
        backend, cache = ctx.backend, ctx.kv_cache
        if (not isinstance(backend, CpuAttentionBackend) or ctx.kv_amax is not None or not is_cpu_fp32(cache)
                or not cache.is_contiguous() or not is_cpu_fp32(x) or not x.is_contiguous()
                or not is_cpu_fp32(cos) or not cos.is_contiguous() or not sin.is_contiguous()):  # fmt: skip
            return None
        tokens = x.shape[0]
        plan = backend.decode_only_plan(ctx.meta, cache.shape[3], tokens)
        if plan is None or tokens == 0:
            return None
        slots = ctx.meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        self._bind_cache(cache)
        out, residual = x, torch.empty_like(x)  # x is this forward's own embedding: overwritten
        scratch = [torch.empty(tokens, n, dtype=torch.float32) for n in (
            self._hidden, self._q_size + 2 * self._kv_size, self._q_size + self._kv_size, self._q_size,
            2 * self._intermediate, self._intermediate,
        )]  # fmt: skip
        step = _Step(
            tokens, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), plan.tables.data_ptr(),
            plan.seq_lens.data_ptr(), plan.rows.data_ptr(), plan.tables.stride(0), plan.max_len,
            out.data_ptr(), residual.data_ptr(), *(t.data_ptr() for t in scratch),
        )  # fmt: skip
        status = self._fn(self._layers, self._num_layers, ctypes.byref(self._shape), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"native decode stack failed with status {status}")
        return out, residual

    def _bind_cache(self, cache: torch.Tensor) -> None:
        """Points each layer at its K/V halves of ``cache`` ``[L, 2, blocks, block_size, KV, D]``."""
        key = (cache.data_ptr(), tuple(cache.shape))
        if key == self._cache_key:
            return
        for i in range(self._num_layers):
            self._layers[i].k_cache = cache[i, 0].data_ptr()
            self._layers[i].v_cache = cache[i, 1].data_ptr()
        num_blocks, block_size = cache.shape[2], cache.shape[3]
        self._shape = _Shape(
            self._hidden, self._num_heads, self._num_kv_heads, self._head_dim, self._intermediate, block_size,
            cache.stride(2), num_blocks * block_size, self._eps, self._scale,
        )  # fmt: skip
        self._cache_key = key


def _packed(linear: Linear) -> tuple[int, int | None]:
    packed = linear.packed
    assert packed is not None and isinstance(packed.packed, torch.Tensor)
    return packed.packed.data_ptr(), None if packed.bias is None else packed.bias.data_ptr()
