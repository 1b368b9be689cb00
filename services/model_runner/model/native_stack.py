"""The decoder-layer stack of a step in one native call (``native/decode_stack.c``).

For steps whose every row is a decode or a row of a prefill chunk (decode steps, mixed steps, a
prompt's chunks), :meth:`NativeDecodeStack.run` hands the whole stack to C, which calls the same
kernels in the same order on the same arguments as the per-layer path, so the hidden states are
bitwise the per-layer path's; what it saves (the Python between kernels) is measured in
docs/model_runner.md. Anything else (padding rows, fp8 calibration, several KV cache groups,
another backend) returns None and the caller runs the layers in Python.

This module is only the binding: it takes plain tensors (:class:`StackLayer`, :class:`StackShape`).
Which model layers can be described so is decided by ``native_layers.py``, the one place that
knows both the model and the native backend.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.model_runner.attention.cpu_backend import CpuAttentionBackend, NativeDecodePlan
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.packed import PackedWeight
from services.model_runner.native import NativeKernels, is_cpu_fp32, is_cpu_kv

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
# PackedWeight modes the stack runs, by their KvmStackShape.gemm code
STACK_MODES = {"native": 0, "native_bf16": 1, "native_int8": 2, "native_q4_1": 3}


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as ``decode_stack.c`` reads it: fp32 norm weights and projections packed
    for one of :data:`STACK_MODES` (all four the same)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


@dataclass(frozen=True)
class StackShape:
    """The shapes every layer of the stack shares."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # softmax scale
    mode: str = "native"  # the PackedWeight mode of every projection, one of STACK_MODES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


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
            "num_slots", "gemm", "window", "kv_bf16",
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
        ("num_decodes", _I64), ("num_chunks", _I64), ("chunk_spans", _P), ("chunk_tables", _P),
        ("chunk_table_stride", _I64), ("num_out", _I64), ("out_rows", _P),
    ]  # fmt: skip


class NativeDecodeStack:
    """Runs a decoder's layers for a step of decodes and prefill chunks in ``kvmesh_decode_stack_f32``.

    Args:
        layers: every layer, in order; their tensors must outlive the stack.
        shape: what the layers share.
        kernels: the native build to call.
    """

    def __init__(self, layers: Sequence[StackLayer], shape: StackShape, kernels: NativeKernels):
        self._num_layers = len(layers)
        self._fn = kernels.decode_stack
        self._dims = shape
        self._layers = (_Layer * len(layers))()
        mode = shape.mode
        if mode not in STACK_MODES:
            raise ValueError(f"the native decode stack runs modes {tuple(STACK_MODES)}, not {mode!r}")
        for i, layer in enumerate(layers):
            if {w.mode for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} != {mode}:
                raise ValueError(f"the native decode stack of this shape needs every projection packed for {mode}")
            entry = self._layers[i]
            entry.input_norm = layer.input_norm.data_ptr()
            entry.post_norm = layer.post_norm.data_ptr()
            entry.qkv, entry.qkv_bias = _packed(layer.qkv)
            entry.o, entry.o_bias = _packed(layer.o)
            entry.gate_up, entry.gate_up_bias = _packed(layer.gate_up)
            entry.down, entry.down_bias = _packed(layer.down)
        # the pool self._layers points into
        self._cache_key: tuple[int, tuple[int, ...], int, torch.dtype | None] = (0, (), 0, None)
        self._shape = _Shape()
        self._scratch = [torch.empty(0, 1)]  # see _scratch_rows

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(last layer's MLP output, residual)`` for the embeddings ``x`` ``[T, hidden]`` (of
        ``ctx.output_rows`` only where set, which the last layer then runs alone), or None when
        this step is not one the stack runs (the caller then runs the layers)."""
        backend, cache = ctx.backend, ctx.kv_cache
        if len(ctx.group_metas) > 1:
            return None  # one KV cache group only: per-group tables per layer go per layer (docs/kv_layout.md)
        if (not isinstance(backend, CpuAttentionBackend) or ctx.kv_amax is not None or not is_cpu_kv(cache)
                or not cache.is_contiguous() or not is_cpu_fp32(x) or not x.is_contiguous()
                or not is_cpu_fp32(cos) or not cos.is_contiguous() or not sin.is_contiguous()):  # fmt: skip
            return None
        tokens = x.shape[0]
        plan = backend.stack_plan(ctx.meta, cache.shape[3], tokens)
        if plan is None or tokens == 0:
            return None
        slots = ctx.meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        # the rows the C code runs the last layer for alone and puts first (it checks them)
        rows = ctx.output_rows
        if rows is not None:
            rows = rows.to(device="cpu", dtype=torch.int64).contiguous()
        self._bind_cache(cache, plan.window)
        out, residual = x, torch.empty_like(x)  # x is this forward's own embedding: overwritten
        scratch = self._scratch_rows(tokens)
        spans, chunk_tables = _chunk_arrays(plan, cache.shape[3])
        step = _Step(
            tokens, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), plan.tables.data_ptr(),
            plan.seq_lens.data_ptr(), plan.rows.data_ptr(), plan.tables.stride(0), plan.max_len,
            out.data_ptr(), residual.data_ptr(), *(t.data_ptr() for t in scratch),
            plan.rows.shape[0], len(plan.chunks), spans.data_ptr(), chunk_tables.data_ptr(), chunk_tables.stride(0),
            -1 if rows is None else rows.shape[0], 0 if rows is None else rows.data_ptr(),
        )  # fmt: skip
        status = self._fn(self._layers, self._num_layers, ctypes.byref(self._shape), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"native decode stack failed with status {status}")
        if rows is None:
            return out, residual
        return out[: rows.shape[0]], residual[: rows.shape[0]]  # all the rows, or the rows put first

    def _scratch_rows(self, tokens: int) -> list[torch.Tensor]:
        """The C code's per-row buffers (norm output, qkv, rotated q/k, attention, gate_up, SwiGLU)
        for ``tokens`` rows: views of buffers kept between steps, grown to the largest step seen.

        NOTE: the C code writes every row of them before reading it, so what a step leaves there
        never reaches the next one; kept, they cost no allocation (and no page faults) per step.
        """
        if self._scratch[0].shape[0] < tokens:
            d = self._dims
            self._scratch = [torch.empty(tokens, n, dtype=torch.float32) for n in (
                d.hidden, d.q_size + 2 * d.kv_size, d.q_size + d.kv_size, d.q_size, 2 * d.intermediate,
                d.intermediate,
            )]  # fmt: skip
        return [buffer[:tokens] for buffer in self._scratch]

    def _bind_cache(self, cache: torch.Tensor, window: int) -> None:
        """Points each layer at its K/V halves of ``cache`` ``[L, 2, blocks, block_size, KV, D]``;
        ``window``: the one KV cache group's (0 = full attention)."""
        key = (cache.data_ptr(), tuple(cache.shape), window, cache.dtype)
        if key == self._cache_key:
            return
        for i in range(self._num_layers):
            self._layers[i].k_cache = cache[i, 0].data_ptr()
            self._layers[i].v_cache = cache[i, 1].data_ptr()
        num_blocks, block_size = cache.shape[2], cache.shape[3]
        s = self._dims
        self._shape = _Shape(
            s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate, block_size,
            cache.stride(2), num_blocks * block_size, STACK_MODES[s.mode], window, int(cache.dtype == torch.bfloat16),
            s.eps, s.scale,
        )  # fmt: skip
        self._cache_key = key


_NO_SPANS, _NO_TABLES = torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int32)


def _chunk_arrays(plan: NativeDecodePlan, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_stack.c``'s chunk arrays: ``[C, 3]`` int64 (first row, rows, ``Chunk.table_len``, as
    ``CpuAttentionBackend`` passes the prefill kernel) and the ``[C, W]`` int32 block tables; a
    decode step (``C`` = 0) allocates nothing."""
    if not plan.chunks:
        return _NO_SPANS, _NO_TABLES
    spans = torch.tensor([[c.start, c.end - c.start, c.table_len(block_size)] for c in plan.chunks], dtype=torch.int64)
    return spans, torch.stack(plan.chunk_tables)


def _packed(weight: PackedWeight) -> tuple[int, int | None]:
    if weight.mode not in STACK_MODES or not isinstance(weight.packed, torch.Tensor):
        raise ValueError(f"the native decode stack needs weights packed for a mode of {tuple(STACK_MODES)}, "
                         f"not {weight.mode}")
    return weight.packed.data_ptr(), None if weight.bias is None else weight.bias.data_ptr()
