"""Pure: the roofline of one decode step (bytes it must move, FLOPs it must do) and its table.

The physical limit of a decode step is whichever is slower: moving the bytes it cannot avoid
(every weight once, every cached K/V of the batch once) at the machine's measured memory
bandwidth, or doing its FLOPs at the machine's measured GEMM peak for the dtype in use::

    bytes  = weights (linear layers incl. the LM head, RMSNorm weights) x bytes per weight
           + batch x context x KV bytes per token            (shared/kv_layout.py owns the formula)
    flops  = 2 x batch x linear weights                        (every GEMM)
           + 4 x batch x context x layers x heads x head_dim   (QK^T and PV)
    bound  = max(bytes / bandwidth, flops / peak)

Left out, because they are below a percent of either sum for a decoder of this shape: the B rows
of the embedding that the step looks up, the activations (B x hidden per layer), rotary tables,
and the norms' and SiLU's FLOPs. ``bench/roofline.py`` measures the bandwidth, the peaks and the
step; everything here is arithmetic, unit-tested with exact values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.kv_layout import gqa_kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
TARGET_RATIO = 1.5  # issue 17: a batch-32 decode step within 1.5x of its roofline


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name as kvmesh reports it (``float32``, ``bfloat16``, ``fp8_e4m3``)."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-style decoder that decide a decode step's cost."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> DecoderShape:
        """From a Hugging Face ``config.json`` dict (``head_dim`` defaults to hidden / heads)."""
        heads = int(cfg["num_attention_heads"])
        return cls(int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["intermediate_size"]), heads,
                   int(cfg.get("num_key_value_heads") or heads),
                   int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), int(cfg["vocab_size"]))

    @property
    def layer_linear_weights(self) -> int:
        """q, k, v, o, gate, up and down of one layer."""
        q = o = self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        return q + o + kv + 3 * self.hidden * self.intermediate

    @property
    def linear_weights(self) -> int:
        """Every GEMM weight of one step: all layers plus the LM head (``vocab x hidden``, tied or not)."""
        return self.num_layers * self.layer_linear_weights + self.vocab_size * self.hidden

    @property
    def norm_weights(self) -> int:
        """Two RMSNorms per layer and the final one."""
        return (2 * self.num_layers + 1) * self.hidden

    def gemm_shapes(self, batch: int) -> tuple[tuple[str, int, int, int], ...]:
        """``(name, m, k, n)`` of one layer's GEMMs (q/k/v fused, gate/up fused) and the LM head."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return (("qkv", batch, self.hidden, qkv), ("o", batch, self.num_heads * self.head_dim, self.hidden),
                ("gate_up", batch, self.hidden, 2 * self.intermediate), ("down", batch, self.intermediate, self.hidden),
                ("lm_head", batch, self.hidden, self.vocab_size))


@dataclass(frozen=True)
class StepCost:
    """What one decode step must move and compute."""

    weight_bytes: int
    kv_bytes: int
    flops: int

    @property
    def total_bytes(self) -> int:
        """Weights plus K/V read."""
        return self.weight_bytes + self.kv_bytes


def decode_step_cost(shape: DecoderShape, batch: int, context: float, weight_dtype: str, kv_dtype: str) -> StepCost:
    """The cost of one step in which ``batch`` sequences each decode one token attending ``context`` tokens."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got {batch} and {context}")
    weight_bytes = _weight_bytes(shape, weight_dtype)
    per_token = gqa_kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes(kv_dtype))
    kv_bytes = round(batch * context * per_token)
    attn = round(4 * batch * context * shape.num_layers * shape.num_heads * shape.head_dim)
    return StepCost(weight_bytes, kv_bytes, 2 * batch * shape.linear_weights + attn)


# Packed weight formats kvmesh reports as its dtype: bytes per weight of the layers' projections and
# of the head (model/packed.py's layouts; scales and minimums are fp32 copies), norms stay fp32.
PACKED_WEIGHT_BYTES = {"q4_1": (0.5 + 8 / 32, 1 + 8 / 32),  # Q4_1 projections, Q8_0 head (d, m per 32)
                       "int8": (1.0, 1.0)}  # int8_weight_only (one fp32 scale per output channel: ~0)


def _weight_bytes(shape: DecoderShape, weight_dtype: str) -> int:
    """Bytes of every weight one decode step streams, in the format the runner holds them in."""
    key = weight_dtype.strip().lower()
    norms = shape.norm_weights * 4
    if key in PACKED_WEIGHT_BYTES:
        layers, head = PACKED_WEIGHT_BYTES[key]
        projections = shape.num_layers * shape.layer_linear_weights
        return round(projections * layers + (shape.linear_weights - projections) * head) + norms
    return (shape.linear_weights + shape.norm_weights) * dtype_bytes(weight_dtype)


def peak_dtype(weight_dtype: str) -> str:
    """The GEMM peak that bounds a step in ``weight_dtype``: Q4_1 weights compute fp32 FMAs over the
    dequantized values, int8 weights bf16 mode's arithmetic."""
    return "float32" if weight_dtype in ("float32", "q4_1") else "bfloat16"


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean context of the decode steps of ``input_len`` + ``output_len``: the prefill samples the first
    token, then step ``j`` (1 .. output_len - 1) attends ``input_len + j`` tokens."""
    if output_len < 2:
        raise ValueError("a workload with decode steps needs output_len >= 2")
    return input_len + output_len / 2


@dataclass(frozen=True)
class Roofline:
    """Memory time, compute time, and the bound (the larger)."""

    memory_s: float
    compute_s: float

    @property
    def bound_s(self) -> float:
        """The roofline step time."""
        return max(self.memory_s, self.compute_s)

    @property
    def limit(self) -> str:
        """``memory`` or ``compute``: which side sets the bound."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


def roofline(cost: StepCost, bandwidth_gb_s: float, peak_gflop_s: float) -> Roofline:
    """The step's lower bound at a bandwidth (GB/s, 1e9 bytes) and a GEMM peak (GFLOP/s)."""
    if bandwidth_gb_s <= 0 or peak_gflop_s <= 0:
        raise ValueError("bandwidth and peak must be > 0")
    return Roofline(cost.total_bytes / (bandwidth_gb_s * 1e9), cost.flops / (peak_gflop_s * 1e9))


def gemm_rate_gflop_s(shapes: Sequence[tuple[str, int, int, int]], seconds: Sequence[float]) -> float:
    """GFLOP/s of a set of GEMMs run once each: their FLOPs (2 m k n) over their summed time."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("one time per shape, at least one shape")
    total = sum(2 * m * k * n for _, m, k, n in shapes)
    return total / sum(seconds) / 1e9


def table_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The markdown table of ``bench/roofline.py``'s rows (one per mode and thread count)."""
    lines = ["| mode | threads | weights / KV | MB moved (weights + KV) | GFLOP | bandwidth GB/s | GEMM peak GFLOP/s "
             "| roofline ms (bound) | measured step ms (median, min - max) | measured ÷ roofline |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["step_s"] / r["roofline_s"]
        verdict = "met" if ratio <= TARGET_RATIO else "**not met**"
        lines.append(
            f"| {r['mode']} | {r['threads']} | {r['weight_dtype']} / {r['kv_dtype']} "
            f"| {r['weight_bytes'] / 1e6:.0f} + {r['kv_bytes'] / 1e6:.0f} | {r['flops'] / 1e9:.2f} "
            f"| {r['bandwidth_gb_s']:.1f} | {r['peak_gflop_s']:.0f} | {r['roofline_s'] * 1e3:.1f} ({r['limit']}) "
            f"| {r['step_s'] * 1e3:.1f} ({r['step_min_s'] * 1e3:.1f} - {r['step_max_s'] * 1e3:.1f}) "
            f"| {ratio:.2f}x (target <= {TARGET_RATIO}x: {verdict}) |")
    return lines
