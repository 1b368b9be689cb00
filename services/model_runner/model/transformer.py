"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Parameter names mirror Hugging Face's (``model.layers.N.self_attn...``) except for the merged
projections (``qkv_proj``, ``gate_up_proj``), so the loader's name map stays a few lines long.
The architectures differ only in config flags (qkv bias, tied embeddings, head_dim, rope, Qwen3's
per-head q/k norms).
"""

from __future__ import annotations

import torch
from torch import nn

from services.model_runner.model.config import ModelConfig
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.layers import MLP, Attention, Embedding, Linear, RMSNorm, RotaryEmbedding
from services.model_runner.model.packed import PackedWeight, linear


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``.

    The residual stream is carried separately (``forward`` returns the block's last output and
    the residual it has not been added to yet), so each residual add fuses with the norm after it
    (:meth:`RMSNorm.add_forward`); the sums are the same fp32 additions as written above.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, hidden], [T, hidden])
        """``(mlp output, residual)``; the layer's output is their sum. ``residual`` None: ``x`` is
        the embedding (the first layer); the residual tensor is updated in place."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


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
        x, residual = self.run_layers(x, cos, sin, ctx)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]  # [T or N, hidden]

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([T or N, hidden], the same or None)
        """``(last layer's MLP output, residual)`` for the embeddings ``x``, of ``ctx.output_rows``
        where set; residual None without layers.

        A backend that runs the whole stack at once overrides this
        (``native_layers.NativeDecoderModel``); the embedding and the final norm stay here. Here
        every row runs every layer and the rows are taken at the end: the torch kernels' bits
        may depend on the row count, so running fewer rows could change the kept rows' results.
        """
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        rows = ctx.output_rows
        if rows is not None:
            x = x[rows]
            residual = residual[rows] if residual is not None else None
        return x, residual


class CausalLM(nn.Module):
    """Decoder plus the vocabulary projection; ``lm_head`` is None when tied to the embedding."""

    def __init__(self, config: ModelConfig, decoder: DecoderModel | None = None):
        """``decoder``: the stack, when not the Llama family's (``deepseek.DeepseekModel`` for an
        MLA config; the loader picks it: this module cannot import that one, which builds on it)."""
        super().__init__()
        if decoder is None and config.mla is not None:
            raise ValueError(f"{config.architecture} needs its own decoder (deepseek.DeepseekModel)")
        self.config = config
        self.model = DecoderModel(config) if decoder is None else decoder
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: PackedWeight | None = None  # a tied head's packed copy (``transforms.prepare_model``)
        self.prepared: str | None = None  # the quantization ``prepare_model`` packed the weights for
        # the dtype the GEMMs compute in when it is not the parameters' (bf16 mode on fp32 master
        # weights, ``prepare_model``); None: the parameters' dtype
        self.compute_dtype: str | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states of every token of the step.

        Args:
            input_ids: ``[T]`` int64, all sequences' new tokens back to back.
            positions: ``[T]`` int64, each token's position in its sequence.
            ctx: the paged cache and batch layout.

        Returns:
            ``[T, hidden]`` final hidden states, or ``[N, hidden]`` those of ``ctx.output_rows``
            where set (pass the rows to sample to :meth:`compute_logits`).
        """
        return self.model(input_ids, positions, ctx)

    @property
    def head_packing(self) -> PackedWeight | None:
        """The vocabulary projection's packed weight: the untied head's, or the tied head's copy;
        None where the head runs on a dense weight."""
        return self.lm_head.packed if self.lm_head is not None else self.packed_head

    def head_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` -> ``[N]`` int64: each row's argmax of :meth:`compute_logits` (the first
        maximum, as greedy sampling takes it), without writing the logits where the packed head's
        native kernel runs (``PackedWeight.argmax``); None elsewhere."""
        head = self.head_packing
        return None if head is None else head.argmax(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits (only the rows that sample)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        return linear(hidden, self.model.embed_tokens.weight).float()
