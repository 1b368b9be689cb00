"""DeepSeek-V2/V3's extra shape: multi-head latent attention (MLA), the MoE block, YaRN rope.

Kept out of ``config.py`` so that :class:`~services.model_runner.model.config.ModelConfig` stays
readable: a Llama-family model has none of these (the fields are None), a ``DeepseekV3ForCausalLM``
has all three, parsed here from its ``config.json`` with transformers' names and defaults
(``configuration_deepseek_v3.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 section 2.1).

    Attributes:
        q_lora_rank: rank of the query's low-rank compression; None = one dense ``q_proj``.
        kv_lora_rank: width of the compressed KV latent ``c_KV`` (what the cache keeps per token).
        qk_nope_head_dim: per head, the query/key part without rotary embedding.
        qk_rope_head_dim: per head, the rotary part of the query; the key's rotary part is one
            vector shared by all heads (cached beside the latent).
        v_head_dim: per head, the value width.
        rope_interleave: the checkpoint's rotary pairs are ``(x0, x1), (x2, x3)...`` (DeepSeek's
            layout), not the two halves.
        attention_bias: ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` carry a bias.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        """Per head, the query/key width: the no-rope part and the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements cached per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3's MoE block: shared experts plus top-k of the routed ones, sigmoid gating with
    a per-expert correction bias that picks experts but does not weight them (``noaux_tc``).

    Attributes:
        n_routed_experts / n_shared_experts / num_experts_per_tok: as transformers names them.
        moe_intermediate_size: each expert's hidden width (the shared experts': times their number).
        n_group / topk_group: experts are split into ``n_group`` groups; a token picks its experts
            from its ``topk_group`` best groups (each group scored by its two best experts).
        routed_scaling_factor: multiplies the routed experts' weights.
        norm_topk_prob: the chosen weights are renormalised to sum to 1 before that scaling.
        first_k_dense_replace: the first layers use a dense MLP (``intermediate_size``), not MoE.
    """

    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int


@dataclass(frozen=True)
class YarnParams:
    """YaRN's rope parameters beyond ``RopeConfig``'s (transformers' ``_compute_yarn_parameters``)."""

    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor / mscale / mscale_all_dim
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``scale`` (1 at or below the original length)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def deepseek_parts(hf: Mapping[str, Any]) -> tuple[MLAConfig, MoEConfig]:
    """The MLA and MoE parts of a DeepSeek-V3 ``config.json``.

    Defaults are transformers' ``DeepseekV3Config`` defaults, so a config.json that omits a field
    means here what it means there.

    Raises:
        ValueError: an option not implemented (``ModelConfig`` reports it as UnsupportedModelError).
    """
    for key, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if hf.get(key, supported) != supported:
            raise ValueError(f"{key} {hf[key]!r} is not supported (only {supported!r}, DeepSeek-V3's)")
    heads = int(hf.get("num_attention_heads", 128))
    kv_heads = hf.get("num_key_value_heads") or heads
    if int(kv_heads) != heads:
        # NOTE: MLA expands the latent to one K/V per query head; transformers' DeepseekV3 cannot
        # run another head count either.
        raise ValueError(f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} vs {heads}")
    q_lora = hf.get("q_lora_rank", 1536)
    mla = MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
        v_head_dim=int(hf.get("v_head_dim") or 128),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
    )
    moe = MoEConfig(
        n_routed_experts=int(hf.get("n_routed_experts", 256)),
        n_shared_experts=int(hf.get("n_shared_experts", 1)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 8),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 2048)),
        n_group=int(hf.get("n_group") or 8),
        topk_group=int(hf.get("topk_group") or 4),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", 3) or 0),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    if moe.n_routed_experts % moe.n_group or moe.n_routed_experts // moe.n_group < 2:
        raise ValueError(f"{moe.n_routed_experts} routed experts do not split into {moe.n_group} groups "
                                    "of at least 2 (each group is scored by its two best experts)")
    if not 0 < moe.topk_group <= moe.n_group or not 0 < moe.num_experts_per_tok <= moe.n_routed_experts:
        raise ValueError(f"topk_group {moe.topk_group} / num_experts_per_tok {moe.num_experts_per_tok} "
                                    f"out of range for {moe.n_group} groups of {moe.n_routed_experts} experts")
    return mla, moe


def yarn_params(params: Mapping[str, Any]) -> YarnParams:
    """The YaRN fields of a rope-parameters dict."""
    def opt(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return YarnParams(
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"), attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


__all__ = ["MLAConfig", "MoEConfig", "YarnParams", "deepseek_parts", "yarn_get_mscale",
           "yarn_params"]
