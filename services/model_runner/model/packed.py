"""The linear layers' CPU kernels: each weight is packed once, after loading, for the kernel that runs it.

``RunnerConfig.quantization`` picks the kernel (benchmarks: docs/model_runner.md)::

    none   fp32 weights in oneDNN's blocked layout, oneDNN's fp32 inner product   (default, exact fp32)
           or, with the native CPU kernels (``attention_backend=cpu``), fp32 weights
           in column panels for ``native/gemm.c`` (mode ``native``, exact fp32)
           or, in bf16 mode on a CPU with AVX512-BF16, bf16 weights in k-pair
           panels for ``native/gemm_bf16.c`` (mode ``native_bf16``: activations
           rounded to bf16 at the input, fp32 accumulation, batch invariant)
    fp16   fp16 weights packed for fbgemm, fp32 arithmetic                          (opt-in)
    int8   int8 weights (per output channel) for fbgemm, activations quantized      (opt-in)
           per call, per tensor ("dynamic quantization")
    int8_weight_only                                                                (opt-in)
           int8 weights (symmetric, one scale per output channel) for
           ``native/gemm_int8.c`` (mode ``native_int8``): widened to bf16 in
           registers, activations rounded to bf16 at the input as in bf16 mode, fp32
           accumulation, batch invariant; half bf16 mode's weight bytes
    q4_1   llama.cpp's Q4_1 blocks for the projections (4-bit codes, an f16 scale   (opt-in)
           and minimum per 32 weights along k) and Q8_0 for the head (8-bit codes,
           an f16 scale per 32), for ``native/gemm_q4_1.c`` (modes ``native_q4_1``
           / ``native_q8_0``): dequantized to fp32 as gguf-py does, then gemm.c's
           fp32 GEMM over those weights, activations unrounded; a fifth of fp32's
           weight bytes, and bitwise fp32 mode where the weights lie on that grid

The packed copy replaces the dense weight, which is freed (vLLM calls this step
``process_weights_after_loading``). Off the CPU, or for fp16/bf16 models, ``none`` packs nothing
and ``F.linear`` runs; ``fp16``/``int8`` need fp32 weights on the CPU.

NOTE: why not ``F.linear``: decode GEMMs are skinny (a few rows times a weight streamed from
memory), where torch's default CPU path (MKL sgemm) is slow; oneDNN on the dense weight re-lays
the weight out on every call, so the weight is packed once (the measurements are in
docs/model_runner.md, "Why the code is shaped so"). All are IEEE fp32 but sum in different
orders, so results differ in the last bits (as MKL's own do between batch sizes); greedy outputs stay token-identical to
transformers in the tests and the benchmark. The ops are those torch's inductor emits for CPU
linears (private, hence :func:`onednn_available`).
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.model_runner.native import NativeKernels, is_cpu_fp32, load_kernels

MODES = ("fp32", "native", "native_bf16", "native_int8", "native_q4_1", "native_q8_0", "fp16", "int8")
NATIVE_MODES = ("native", "native_bf16", "native_int8", "native_q4_1", "native_q8_0")
Q_BITS = {"native_q4_1": 4, "native_q8_0": 8}  # the grouped modes' code widths (gemm_q4_1.c)
Q4_MAX = 15  # Q4_1's codes: 0..15 above the group's minimum
Q8_MAX = 127  # Q8_0's codes: -127..127, symmetric
INT8_MAX = 127  # symmetric: -127..127, so a scale maps the channel's largest |w| to +-127 exactly
PACK_BATCH = 32  # the batch oneDNN's layout is tuned for; any batch runs (as fast at 1 and 8, measured)
# logits per block of PackedWeight.argmax (native/head_argmax.c): 512 KB of fp32, which stay in a Zen 4
# or Sapphire Rapids core's 1-2 MB L2 beside the weight panels streaming through it
ARGMAX_BLOCK_FLOATS = 1 << 17


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear ops (``torch.ops.mkldnn``)."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(
            ops, "_reorder_linear_weight"
        )
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on a dense weight; through oneDNN for fp32 on the CPU (see the module NOTE)."""
    if _ONEDNN and is_cpu_fp32(x) and is_cpu_fp32(weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class ArgmaxScreen(Protocol):
    """What ``PackedWeight.argmax`` asks first where a head has one (``model/head_screen.py``): each
    row's greedy token written into ``out`` (True), or False for the full head to run instead."""

    def argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor,
               block: int, out: torch.Tensor) -> bool: ...

    def describe(self) -> str:
        """What scores the columns, for the runner's log."""
        ...


class PackedWeight:
    """A ``[out, in]`` weight (and bias) packed for one kernel; ``packed(x)`` is ``x W^T + b``.

    Args:
        weight: the dense weight, fp32 on the CPU (it is copied; the caller may free it).
        bias: ``[out]`` or None.
        mode: ``fp32`` (oneDNN), ``native`` (``native/gemm.c``), ``native_bf16``
            (``native/gemm_bf16.c``), ``native_int8`` (``native/gemm_int8.c``), ``fp16`` or
            ``int8`` (fbgemm), see the module docstring.
        kernels: for ``native``, the kernels to run on (default: :func:`load_kernels`'s build).

    NOTE: ``int8`` quantizes activations per call and per tensor with torch's x86 ``reduce_range``
    (7-bit), so a row's result depends a little on the other rows of the batch. The fbgemm ops
    come from torch's ``quantized`` namespace, whose quantized-tensor API is deprecated upstream;
    kept because no other CPU int8 GEMM in torch 2.13 is fast here (``_weight_int8pack_mm`` is
    far slower than fbgemm's, docs/model_runner.md).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
                 kernels: NativeKernels | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not is_cpu_fp32(weight):
            raise ValueError(f"packed weights need fp32 weights on the CPU, not {weight.dtype} ({weight.device})")
        if mode == "fp32" and not _ONEDNN:
            raise ValueError("this torch build has no oneDNN linear ops")
        self.kernels: NativeKernels | None = None
        if mode in NATIVE_MODES:
            self.kernels = kernels or load_kernels()
            if self.kernels is None:
                raise ValueError("the native CPU kernels could not be built here")
            if mode == "native_bf16" and self.kernels.linear_bf16 is None:
                raise ValueError("the native bf16 GEMM is not built here (the CPU has no AVX512-BF16)")
            if mode == "native_int8" and self.kernels.linear_int8 is None:
                raise ValueError("the native int8 GEMM is not built here (the CPU has no AVX512-BF16)")
        self.mode = mode
        self._scratch = torch.empty(0)  # argmax's logit blocks
        # a head's cheaper copy that screens the columns of argmax (``transforms.prepare_model``)
        self.screen: ArgmaxScreen | None = None
        weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.packed: object
        if self.kernels is not None and mode == "native_bf16":
            self.packed = pack_panels_bf16(weight, self.kernels.panel_width)
        elif self.kernels is not None and mode == "native_int8":
            self.packed = pack_int8(*quantize_int8(weight), self.kernels.panel_width)
        elif self.kernels is not None and mode in Q_BITS:
            quantize = quantize_q4_1 if mode == "native_q4_1" else quantize_q8_0
            self.packed = pack_q_groups(*quantize(weight, self.kernels.q_group), bits=Q_BITS[mode],
                                        width=self.kernels.panel_width, group=self.kernels.q_group)
        elif self.kernels is not None:
            self.packed = pack_panels(weight, self.kernels.panel_width)
        elif mode == "fp32":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH)
        elif mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, self.bias)
        else:
            scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [out], symmetric
            zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # the quantized-tensor deprecation notice
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
                self.packed = torch.ops.quantized.linear_prepack(qweight, self.bias)

    @staticmethod
    def supported(weight: torch.Tensor, mode: str) -> bool:
        """Whether ``weight`` can be packed for ``mode`` in this build."""
        if mode in NATIVE_MODES:
            kernels = load_kernels()
            gemm = None if kernels is None else _gemm(kernels, mode)
            return is_cpu_fp32(weight) and gemm is not None
        return is_cpu_fp32(weight) and (mode != "fp32" or _ONEDNN)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] fp32 -> [T, out] fp32
        if self.kernels is not None:
            return self._native(self.kernels, x)
        if self.mode == "fp32":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.mode == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[T]`` int64: each row's argmax of ``self(x)``, exactly ``sampler.greedy_tokens`` of
        those logits (the first maximum; a NaN counts as the maximum), computed without writing
        the ``[T, out]`` logits (``native/head_argmax.c``); None where that kernel does not run
        this mode (the caller then takes the logits)."""
        kernels = self.kernels
        if kernels is None or kernels.linear_argmax is None or self.mode not in ("native", "native_bf16"):
            return None
        x = self._checked(x)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        if not x.shape[0]:
            return tokens
        width, rows = kernels.panel_width, x.shape[0]
        whole = -(-self.out_features // width) * width
        block = max(width, min(whole, ARGMAX_BLOCK_FLOATS // rows // width * width))
        if self._scratch.numel() < rows * block:  # kept between calls: no allocation, no page faults per step
            self._scratch = torch.empty(rows * block, dtype=torch.float32)
        packed = self.packed
        assert isinstance(packed, torch.Tensor)
        if self.screen is not None and self.screen.argmax(x, packed, self.bias, self._scratch, block, tokens):
            return tokens
        status = kernels.linear_argmax(
            x.data_ptr(), x.stride(0), x.shape[0], self.in_features, packed.data_ptr(), self.out_features,
            None if self.bias is None else self.bias.data_ptr(), int(self.mode == "native_bf16"),
            self._scratch.data_ptr(), block, tokens.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native {self.mode} head argmax failed with status {status}")
        return tokens

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or not is_cpu_fp32(x):
            raise ValueError(f"expected fp32 [T, {self.in_features}] on the CPU, got {x.dtype} {tuple(x.shape)}")
        return x if x.stride(1) == 1 else x.contiguous()

    def _native(self, kernels: NativeKernels, x: torch.Tensor) -> torch.Tensor:
        x = self._checked(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            packed = self.packed
            assert isinstance(packed, torch.Tensor)
            status = _gemm(kernels, self.mode)(
                x.data_ptr(), x.stride(0), x.shape[0], self.in_features, packed.data_ptr(), self.out_features,
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), out.stride(0),
            )  # fmt: skip
            if self.mode != "native" and status != 0:
                raise RuntimeError(f"native {self.mode} GEMM failed with status {status}")
        return out


def _gemm(kernels: NativeKernels, mode: str) -> Any:
    """The native entry point of a ``NATIVE_MODES`` mode (None: not built here)."""
    return {"native": kernels.linear, "native_bf16": kernels.linear_bf16, "native_int8": kernels.linear_int8,
            "native_q4_1": kernels.linear_q4_1, "native_q8_0": kernels.linear_q8_0}[mode]


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``[out, in]`` -> ``[ceil(out / width), in, width]``: per panel of ``width`` output columns,
    its weights row by row over ``in`` (``native/gemm.c``'s layout; columns past ``out`` are 0)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // width)
    padded = weight.new_zeros(panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(panels, width, in_features).transpose(1, 2).contiguous()


def pack_panels_bf16(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``[out, in]`` fp32 -> bf16 ``[ceil(out / width), ceil(in / 2), width, 2]``: per panel of
    ``width`` output columns and per pair of inputs, each column's two weights side by side (the
    operand layout of AVX512-BF16's ``vdpbf16ps``; ``native/gemm_bf16.c``). Rounded to nearest
    even; columns past ``out`` and an odd ``in``'s last pair half are 0."""
    out_features, in_features = weight.shape
    panels, pairs = -(-out_features // width), -(-in_features // 2)
    padded = weight.new_zeros(panels * width, pairs * 2)
    padded[:out_features, :in_features] = weight
    return padded.to(torch.bfloat16).view(panels, width, pairs, 2).transpose(1, 2).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` fp32 -> (int8 ``[out, in]``, fp32 scales ``[out]``): symmetric, one scale per
    output channel, ``w ~ q * scale`` with ``q = round(w / scale)`` (half to even) in -127..127
    and ``scale = max |w| / 127`` (1 for an all-zero channel). The one quantization rule of
    ``native_int8``: the kernel and the tests' torch reference both start from it."""
    amax = weight.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(weight / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales.float()


def pack_int8(q: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
    """int8 ``[out, in]`` + scales ``[out]`` -> one uint8 buffer (``native/gemm_int8.c``'s layout):
    the scales as fp32 ``[ceil(out / width) * width]`` (0 past ``out``), then the weights
    ``[ceil(out / width), ceil(in / 2), width, 2]`` int8: :func:`pack_panels_bf16`'s layout
    with int8 elements (columns past ``out`` and an odd ``in``'s last pair half are 0)."""
    out_features, in_features = q.shape
    panels, pairs = -(-out_features // width), -(-in_features // 2)
    padded = q.new_zeros(panels * width, pairs * 2)
    padded[:out_features, :in_features] = q
    panel_q = padded.view(panels, width, pairs, 2).transpose(1, 2).contiguous()
    padded_scales = scales.new_zeros(panels * width)
    padded_scales[:out_features] = scales
    return torch.cat([padded_scales.view(torch.uint8), panel_q.view(-1).view(torch.uint8)])


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``[out, in]`` -> ``[out, ceil(in / group), group]``; a short last group is padded with its
    own last weight, which changes neither its minimum, maximum nor largest magnitude."""
    out_features, in_features = weight.shape
    groups = -(-in_features // group)
    padded = weight[:, -1:].expand(out_features, groups * group).clone()
    padded[:, :in_features] = weight
    return padded.view(out_features, groups, group)


def quantize_q4_1(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` fp32 -> (uint8 codes ``[out, in]`` in 0..15, scales ``d`` and minimums ``m``
    ``[out, ceil(in / group)]`` fp32): llama.cpp's Q4_1 per ``group`` weights along ``in``, with
    ``d = (max - min) / 15`` and ``m = min`` rounded to f16 as its files store them, and each code
    ``round((w - m) / d)`` from those stored values. The one rule of ``native_q4_1``: the kernel
    and the tests' reference (:func:`dequantize_groups`) start from it. A weight already on such a
    grid (a checkpoint dequantized from a Q4_1 file) comes back exactly."""
    g = _grouped(weight.float(), group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    fmax = torch.finfo(torch.float16).max
    d = ((hi - lo) / Q4_MAX).clamp(max=fmax).to(torch.float16).float()
    m = lo.clamp(-fmax, fmax).to(torch.float16).float()
    steps = torch.where(d[..., None] > 0, (g - m[..., None]) / d[..., None], torch.zeros_like(g))
    codes = torch.round(steps).clamp_(0, Q4_MAX).to(torch.uint8)
    return codes.view(weight.shape[0], -1)[:, : weight.shape[1]].contiguous(), d, m


def quantize_q8_0(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` fp32 -> (int8 codes ``[out, in]`` in -127..127, scales ``d``, zero minimums
    ``m``, both ``[out, ceil(in / group)]`` fp32): llama.cpp's Q8_0 per ``group`` weights along
    ``in``, ``d = max |w| / 127`` rounded to f16, each code ``round(w / d)``. The head's format
    under ``quantization=q4_1`` (as in llama.cpp's Q4_1 files of small models)."""
    g = _grouped(weight.float(), group)
    d = (g.abs().amax(dim=2) / Q8_MAX).clamp(max=torch.finfo(torch.float16).max).to(torch.float16).float()
    steps = torch.where(d[..., None] > 0, g / d[..., None], torch.zeros_like(g))
    codes = torch.round(steps).clamp_(-Q8_MAX, Q8_MAX).to(torch.int8)
    return codes.view(weight.shape[0], -1)[:, : weight.shape[1]].contiguous(), d, torch.zeros_like(d)


def dequantize_groups(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 weights the grouped kernels compute on: ``fl(fl(d * q) + m)``, two roundings in
    that order (gguf-py's, hence transformers' GGUF loading), never one fused multiply-add."""
    out_features, in_features = codes.shape
    q = codes.float()
    if in_features % group:
        q = F.pad(q, (0, d.shape[1] * group - in_features))
    grouped = (q.view(out_features, -1, group) * d[..., None]) + m[..., None]
    return grouped.view(out_features, -1)[:, :in_features]


def pack_q_groups(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, width: int,
                  group: int) -> torch.Tensor:
    """Codes ``[out, in]`` + ``d``, ``m`` ``[out, groups]`` -> one uint8 buffer in
    ``native/gemm_q4_1.c``'s layout: per panel of ``width`` output columns and per group of
    ``group`` k rows, ``d`` fp32 ``[width]``, ``m`` fp32 ``[width]``, then the group's rows of codes
    (``bits`` 4: ``width / 2`` bytes a row, column ``c`` in the low nibble of byte ``c`` and column
    ``c + width / 2`` in its high one; 8: ``width`` int8). Columns past ``out`` and rows past
    ``in`` are zero."""
    if bits not in (4, 8) or width % 2:
        raise ValueError(f"bits must be 4 or 8 and width even, got {bits} and {width}")
    out_features, in_features = codes.shape
    panels, groups = -(-out_features // width), d.shape[1]
    q = torch.zeros(panels * width, groups * group, dtype=torch.uint8)
    q[:out_features, :in_features] = codes.view(torch.uint8)
    rows = q.view(panels, width, groups, group).permute(0, 2, 3, 1)  # [panel, group, k, column]
    if bits == 4:
        rows = rows[..., : width // 2] | (rows[..., width // 2 :] << 4)
    scales = torch.zeros(2, panels * width, groups, dtype=torch.float32)
    scales[0, :out_features], scales[1, :out_features] = d, m
    heads = scales.view(2, panels, width, groups).permute(1, 3, 0, 2).contiguous()  # [panel, group, 2, width]
    parts = (heads.view(panels, groups, -1).view(torch.uint8), rows.reshape(panels, groups, -1))
    return torch.cat(parts, dim=2).reshape(-1).contiguous()
