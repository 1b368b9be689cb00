"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Per token and layer the cache keeps what transformers' ``DeepseekV3Attention`` caches, one plane
of ``kv_lora_rank + qk_rope_head_dim`` elements, not per-head K and V (docs/mla.md)::

    x ─ kv_a_proj_with_mqa ─┬─ c_KV [kv_lora_rank] ─ kv_a_layernorm ─┐
                            └─ k_rope [rope_dim] ─ rotary ───────────┴─ cache: [c_KV | k_rope]

    attention, per sequence: gather its cached [c_KV | k_rope] rows, up-project
        kv_b_proj(c_KV) -> per head [k_nope | v];  k = [k_nope | k_rope (shared by all heads)]
        q = [q_nope | rotary(q_rope)] (q from q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x))))
        out = o_proj(softmax(q k^T * scale) v)

The up-projection form is the reference's own computation (the same ``kv_b_proj`` over the same
cached latents, then ordinary attention), so fp32 outputs match transformers to rounding; the
absorbed form (``W_UK`` folded into q, ``W_UV`` after attention: vLLM's decode path) saves the
up-projection's FLOPs at long contexts but sums in another order. The attention backend must
implement :class:`MLABackend` (the torch backend does; ``factory.select_backend`` refuses others).

Rotary: DeepSeek checkpoints pair dimensions ``(x0, x1), (x2, x3)...`` (``rope_interleave``);
de-interleaving to ``[x0, x2, ... | x1, x3, ...]`` and rotating halves gives bitwise
transformers' ``apply_rotary_pos_emb_interleave`` (its output is in the halves layout too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.model.config import ModelConfig
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.layers import ApplyRotary, Linear, RMSNorm
from services.model_runner.model.yarn import mla_softmax_scale
from shared.errors import FailedPrecondition


@runtime_checkable
class MLABackend(Protocol):
    """What an attention backend adds for MLA (``attention/torch_mla.py``)."""

    name: str

    def write_latent(self, entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     scale: float = 1.0) -> None:
        """Stores ``entry`` ``[T, 1, C]`` at its slots of ``cache`` ``[num_blocks, block_size, 1, C]``."""
        ...

    def forward_mla(
        self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, softmax_scale: float,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], v_dim: int, scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, Dk]`` over each sequence's cached entries, which
        ``expand`` turns from ``[..., S, C]`` into ``(k [..., S, H, Dk], v [..., S, H, v_dim])``;
        returns ``[T, H, v_dim]``."""
        ...


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` pairs ``(x0, x1), (x2, x3)...`` -> ``[x0, x2, ..., x1, x3, ...]`` (a copy)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """DeepSeek's attention of layer ``layer_idx``; parameter names mirror transformers'."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("MLAttention needs a config with an MLA part")
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.mla = mla
        hidden, heads = config.hidden_size, config.num_heads
        q_size = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # transformers' default eps, as its reference
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, bias=False)
            self.q_proj = None
        self.kv_a_proj_with_mqa = Linear(hidden, mla.cache_dim, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=mla.attention_bias)
        self.rotate = ApplyRotary()
        self.scale = mla_softmax_scale(config.rope, mla.qk_head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, hidden]
        mla, num_tokens, heads = self.mla, x.shape[0], self.num_heads
        backend = ctx.backend
        if not isinstance(backend, MLABackend):
            raise FailedPrecondition(f"attention backend {backend.name!r} does not implement MLA; use torch")
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, kv_lora_rank]
        k_rope = k_rope.reshape(num_tokens, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = self.rotate(q_rope.contiguous(), cos, sin), self.rotate(k_rope.contiguous(), cos, sin)
        entry = torch.cat((latent.unsqueeze(1), k_rope), dim=-1)  # [T, 1, C]
        if ctx.kv_amax is not None:
            torch.maximum(ctx.kv_amax[self.layer_idx], entry.abs().amax().float(), out=ctx.kv_amax[self.layer_idx])
        cache = ctx.kv_cache[self.layer_idx, 0]  # [blocks, block_size, 1, C]
        scale = ctx.kv_scales[self.layer_idx][0]
        backend.write_latent(entry, cache, ctx.meta.slot_mapping, scale)
        query = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, Dk]
        out = backend.forward_mla(query, cache, ctx.meta, self.scale, self.expand, mla.v_head_dim, scale)  # [T, H, Dv]
        return self.o_proj(out.reshape(num_tokens, heads * mla.v_head_dim))

    def expand(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``[..., S, C]`` -> ``(k [..., S, H, nope + rope], v [..., S, H, v_head_dim])``."""
        mla, heads = self.mla, self.num_heads
        lead = entries.shape[:-1]
        latent, k_rope = entries.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent.reshape(-1, mla.kv_lora_rank)).view(*lead, heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.unsqueeze(-2).expand(*lead, heads, mla.qk_rope_head_dim)), dim=-1)
        return k, v
