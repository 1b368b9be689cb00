"""The decoder-only transformer shared by Llama, Mistral and Qwen2 checkpoints.

Parameter names mirror Hugging Face's (``model.layers.N.self_attn...``) except for the merged
projections (``qkv_proj``, ``gate_up_proj``), so the loader's name map stays a few lines long.
The three architectures differ only in config flags (qkv bias, tied embeddings, head_dim, rope).
"""

from __future__ import annotations

import torch
from torch import nn

from services.model_runner.model.config import ModelConfig
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.layers import MLP, Attention, Embedding, Linear, RMSNorm, RotaryEmbedding
from services.model_runner.model.packed import QUANTIZATIONS, PackedWeight, linear


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, hidden]
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.*``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # each [T, 1, D], gathered once for all layers
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)  # [T, hidden]


class CausalLM(nn.Module):
    """Decoder plus the vocabulary projection; ``lm_head`` is None when tied to the embedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: PackedWeight | None = None  # a tied head's fp16/int8 copy (see prepare)
        self.prepared: str | None = None  # the quantization prepare() packed the weights for

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states of every token of the step.

        Args:
            input_ids: ``[T]`` int64, all sequences' new tokens back to back.
            positions: ``[T]`` int64, each token's position in its sequence.
            ctx: the paged cache and batch layout.

        Returns:
            ``[T, hidden]`` final hidden states (pass the rows to sample to :meth:`compute_logits`).
        """
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits (only the rows that sample)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        return linear(hidden, self.model.embed_tokens.weight).float()

    def prepare(self, quantization: str = "none") -> None:
        """Packs the loaded weights for the CPU kernels of ``quantization`` (see ``model/packed.py``).

        ``none`` packs fp32 weights for oneDNN when they are fp32 on the CPU and does nothing
        otherwise. A tied head keeps using the embedding's dense weight under ``none`` (a packed
        copy would add 113 MB to SmolLM2 for ~4 ms per batch-32 step); under ``fp16``/``int8``
        it gets a packed copy (the embedding stays fp32 for the lookups). Call it once, after
        loading; a second call with the same ``quantization`` does nothing.

        Raises:
            ValueError: an unknown ``quantization``, another one than the model was prepared
                for, or ``fp16``/``int8`` on weights that are not fp32 on the CPU.
        """
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if self.prepared is not None:
            if self.prepared != quantization:
                raise ValueError(f"the model is already prepared for quantization {self.prepared!r}")
            return
        mode = "fp32" if quantization == "none" else quantization
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if quantization != "none" or all(PackedWeight.supported(m.weight, mode) for m in linears):
            for module in linears:
                module.pack(mode)
        if self.lm_head is None and quantization != "none":
            self.packed_head = PackedWeight(self.model.embed_tokens.weight, None, mode)
        self.prepared = quantization
