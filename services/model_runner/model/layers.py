"""Building blocks of the Llama-family decoder: linear, RMSNorm, rotary embedding, attention, MLP.

Every layer works on flattened tokens (``[T, hidden]``, all sequences of a step back to back), so
one forward serves prefill chunks and decodes alike; the attention backend is what knows where
one sequence ends. Parameters are created empty: the loader fills every one of them, so random
initialisation would only cost time.

The elementwise ops a faster backend may replace (:class:`RMSNorm`, :class:`ApplyRotary`,
:class:`SiluAndMul`) are modules of their own, so that backend swaps them from outside
(``native_layers.py``) and no layer carries a flag for it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.model_runner.attention.int4 import rotate_groups
from services.model_runner.model.config import ModelConfig, RopeConfig
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.packed import PackedWeight, linear
from services.model_runner.native import NativeKernels


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``shard_sizes`` splits the output rows of a merged projection.

    NOTE: q/k/v and gate/up are merged into one matmul each (fewer, larger GEMMs); the loader
    copies each HF tensor into its row range, given by :meth:`shard_offset`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_sizes: tuple[int, ...] = ()):
        super().__init__()
        self.shard_sizes = shard_sizes or (out_features,)
        if sum(self.shard_sizes) != out_features:
            raise ValueError(f"shards {self.shard_sizes} do not add up to {out_features}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """``(first row, number of rows)`` of one shard of the output."""
        return sum(self.shard_sizes[:shard]), self.shard_sizes[shard]

    def pack(self, mode: str, kernels: NativeKernels | None = None) -> None:
        """Replaces the loaded weight by a :class:`PackedWeight` for ``mode``; frees the dense copy."""
        self.packed = PackedWeight(self.weight, self.bias, mode, kernels)
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of ``weight`` (``[vocab, hidden]``), also the lm_head when tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # NOTE: one call instead of six Python-level ops and their temporaries (faster, see
            # docs/model_runner.md); in fp32 its result is bitwise the reference formula below
            # (checked on SmolLM2's shapes; the tests compare with HF).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place: the caller owns ``residual``), then ``(norm(residual), residual)``.

        The pre-norm block's residual add fused with the next norm (one pass in the native
        backend's :class:`~services.model_runner.model.native_layers.NativeRMSNorm`).
        """
        residual.add_(x)
        return self.forward(residual), residual


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies, rescaled per ``rope.rope_type``.

    ``linear`` divides every frequency by ``factor`` (position interpolation). ``llama3`` divides
    only the low frequencies (wavelength above ``original_max / low_freq_factor``), keeps the
    high ones, and blends linearly in between, as Llama 3.1 was trained.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``forward(positions)`` gathers the rows of a step once.

    ``sin`` is stored *signed*: its first half negated, which folds the minus of HF's
    ``rotate_half(x) = cat(-x2, x1)`` into the table (``(-a) * b == a * (-b)`` exactly), so
    :func:`apply_rotary` needs no negation per layer.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0):
        """``inv_freq`` / ``attention_factor``: frequencies and a cos/sin multiplier computed
        elsewhere (YaRN, ``yarn.py``); default: :func:`rope_inv_freq`'s, unscaled."""
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim) if inv_freq is None else inv_freq  # [D/2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))  # [D]
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)``, each ``[T, 1, D]`` in ``dtype`` (broadcast over heads)."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[T, heads, D]`` by position (the "rotate half" layout of HF checkpoints).

    ``x * cos + cat(-x2, x1) * sin`` as HF computes it, with the minus already in the signed
    ``sin`` of :class:`RotaryEmbedding`: ``roll(x, D/2) == cat(x2, x1)``. Same roundings, 4 ops.
    """
    rotated = x.roll(x.shape[-1] // 2, dims=-1)  # [T, heads, D]
    return torch.mul(x, cos).add_(rotated.mul_(sin))


class ApplyRotary(nn.Module):
    """:func:`apply_rotary` as a module: the op each attention layer applies to its q and k heads."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, heads, D]
        return apply_rotary(x, cos, sin)


class SiluAndMul(nn.Module):
    """SwiGLU's activation on a merged projection: ``silu(gate) * up`` for ``[T, 2I]`` -> ``[T, I]``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)  # each [T, I]
        # NOTE: in place into the (temporary) gate_up output: two fewer [T, I] allocations, same values.
        return F.silu(gate, inplace=True).mul_(up)


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads over the paged cache of layer ``layer_idx``.

    The layer's K/V live in slot ``kv_slot`` of the pool, addressed through the block tables of
    its KV cache group ``kv_group`` (``ModelConfig.kv_groups``), whose metadata also carries the
    layer's sliding window. In attention-sinks mode (``ctx.streaming``) only the query is rotated
    here (``cos``/``sin`` are then of its cache position) and the key is cached unrotated.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kv_group, self.kv_slot = next(
            (g, group.layers.index(layer_idx)) for g, group in enumerate(config.kv_groups) if layer_idx in group.layers
        )
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.rotate = ApplyRotary()
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.qkv_bias,
            shard_sizes=(self.q_size, self.kv_size, self.kv_size),
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # Qwen3: each query and key head RMS-normed over head_dim before rotary
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KV) * D]
        # NOTE: q and k are adjacent in qkv, so one rotary call serves both heads at once.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_heads, k_heads = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q_heads), self.k_norm(k_heads)), dim=1)  # [T, H + KV, D]
        if ctx.streaming is None:
            q, k = self.rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H/KV, D]
        else:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.rotate(q, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        if ctx.kv_amax is not None:
            amax = torch.stack((k.abs().amax(), v.abs().amax())).float()  # [2]
            torch.maximum(ctx.kv_amax[self.layer_idx], amax, out=ctx.kv_amax[self.layer_idx])
        if ctx.kv_rotation is not None:  # INT4 with Hadamard: q.k unchanged, out rotated back below
            q, k, v = (rotate_groups(t, ctx.kv_rotation) for t in (q, k, v))
        k_cache, v_cache = ctx.kv_cache[self.kv_slot].unbind(0)  # each [blocks, block_size, KV, D]
        k_scale, v_scale = ctx.kv_scales[self.layer_idx]
        meta = ctx.group_meta(self.kv_group)
        ctx.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if ctx.streaming is not None:
            out = ctx.streaming.forward(q, k_cache, v_cache, meta, self.scale, self.rotate)
        else:
            out = ctx.backend.forward(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale)  # [T, H, D]
        if ctx.kv_rotation is not None:
            out = rotate_groups(out, ctx.kv_rotation)  # H H = I
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate and up merged."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=config.mlp_bias, shard_sizes=(size, size))
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]
