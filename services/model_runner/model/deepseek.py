"""DeepSeek-V3's decoder stack: MLA attention in every layer, a dense MLP in the first
``first_k_dense_replace`` layers and the MoE block after them (transformers' ``DeepseekV3Model``).

It reuses the Llama-family plumbing: :class:`DeepseekDecoderLayer` is a :class:`DecoderLayer`
with other children (the same pre-norm residual flow), :class:`DeepseekModel` a
:class:`DecoderModel` whose rotary tables have the rope width ``qk_rope_head_dim`` (and YaRN's
frequencies and attention factor when the checkpoint uses it). ``CausalLM`` picks it for a config
with an MLA part, so the loader, the runner and the sampler are the same for every model.
"""

from __future__ import annotations

from torch import nn

from services.model_runner.model.config import ModelConfig
from services.model_runner.model.layers import MLP, Embedding, RMSNorm, RotaryEmbedding
from services.model_runner.model.mla import MLAttention
from services.model_runner.model.moe import MoE
from services.model_runner.model.transformer import DecoderLayer, DecoderModel
from services.model_runner.model.yarn import yarn_inv_freq


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm block with MLA attention and a dense MLP or the MoE block (``forward``: DecoderLayer's)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        # NOTE: nn.Module's init, not DecoderLayer's: the children are DeepSeek's, not Llama's.
        nn.Module.__init__(self)
        moe = config.moe
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_idx)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = moe is None or layer_idx < moe.first_k_dense_replace
        self.mlp = MLP(config) if dense else MoE(config, moe)  # type: ignore[arg-type, assignment]


class DeepseekModel(DecoderModel):
    """Embedding, the DeepSeek layers and the final norm (``forward``: DecoderModel's)."""

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        mla = config.mla
        if mla is None:
            raise ValueError("DeepseekModel needs a config with an MLA part")
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dim = mla.qk_rope_head_dim
        if config.rope.rope_type == "yarn":
            inv_freq, factor = yarn_inv_freq(config.rope, dim)
            self.rotary = RotaryEmbedding(config.rope, dim, config.max_position_embeddings, inv_freq, factor)
        else:
            self.rotary = RotaryEmbedding(config.rope, dim, config.max_position_embeddings)
