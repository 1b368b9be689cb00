"""Tiny random DeepSeek-V3 checkpoints (MLA + MoE), saved with transformers' ``save_pretrained``.

Three layers: layer 0 dense, layers 1-2 MoE (8 routed experts in groups, one shared expert), a
random ``e_score_correction_bias`` so the bias really changes which experts are picked. Two
variants cover both query paths and both rotary layouts:

- ``ds_qlora``: ``q_lora_rank`` 48 (q_a_proj -> q_a_layernorm -> q_b_proj), interleaved rope,
  4 groups of which 2 are picked, normalised top-k weights;
- ``ds_dense_q``: ``q_lora_rank`` None (one q_proj), rotate-half rope, YaRN (factor 4, mscale
  and mscale_all_dim set, so the softmax scale and cos/sin carry YaRN's factors), one group,
  unnormalised weights, attention biases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

BASE: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 512, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": None,
    "pad_token_id": 0,
}  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "ds_qlora": {"q_lora_rank": 48, "rope_interleave": True, "n_group": 4, "topk_group": 2, "norm_topk_prob": True},
    "ds_dense_q": {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 128,
                            "beta_fast": 32.0, "beta_slow": 1.0},
    },
}  # fmt: skip
CACHE_DIM = 32 + 8  # kv_lora_rank + qk_rope_head_dim: elements cached per token and layer


def build_deepseek(folder: Path, name: str, seed: int = 0) -> Path:
    """Saves the tiny DeepSeek-V3 ``name`` (one of :data:`VARIANTS`) into ``folder``."""
    config = DeepseekV3Config(**{**BASE, **VARIANTS[name]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
