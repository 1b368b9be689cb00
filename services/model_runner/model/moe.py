"""DeepSeek-V3's mixture-of-experts block: shared experts plus the top-k routed ones per token.

Routing (``noaux_tc``, transformers' ``DeepseekV3TopkRouter``) runs in float32 on float32 router
weights whatever the model's dtype, as the reference keeps them::

    scores  = sigmoid(x W_gate^T)                                [T, E]
    choice  = scores + e_score_correction_bias                   (the bias picks, it never weighs)
    groups  = the topk_group groups whose two best choices sum highest (E split into n_group groups)
    experts = the num_experts_per_tok best choices inside those groups
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

    out = sum_k weights_k * expert_k(x) + shared_experts(x)

Each routed expert is a SwiGLU :class:`~services.model_runner.model.layers.MLP` run on the rows
routed to it (loops over the experts hit in the step, like the reference's eager path); the shared
experts are one MLP of ``n_shared_experts x moe_intermediate_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_runner.model.config import ModelConfig
from services.model_runner.model.layers import MLP
from services.model_runner.model.mla_config import MoEConfig


class TopkRouter(nn.Module):
    """The gate: ``(weights [T, k] float32, expert ids [T, k])`` per token.

    Its parameters are marked ``keep_fp32`` so the loader leaves them float32 (transformers'
    ``_keep_in_fp32_modules_strict``): the routing decision must not change with the model dtype.
    """

    def __init__(self, config: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.n_routed_experts), requires_grad=False)
        for param in (self.weight, self.e_score_correction_bias):
            param.keep_fp32 = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden]
        moe, num_tokens = self.moe, x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = moe.n_routed_experts // moe.n_group
        group_scores = choice.view(num_tokens, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(num_tokens, -1)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        experts = torch.topk(choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts plus shared experts (HF's ``DeepseekV3MoE``); parameter names mirror HF's
    (``experts.N.gate_proj`` ... land in each expert's merged ``gate_up_proj``)."""

    def __init__(self, config: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.gate = TopkRouter(config, moe)
        self.experts = nn.ModuleList(MLP(config, moe.moe_intermediate_size) for _ in range(moe.n_routed_experts))
        self.shared_experts = MLP(config, moe.moe_intermediate_size * moe.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, experts = self.gate(x)  # [T, k] float32, [T, k]
        routed = torch.zeros_like(x)
        # NOTE: one host sync per layer for the experts hit; a CPU step this size is dominated by
        # the expert GEMMs themselves.
        for expert in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == expert)
            out = self.experts[expert](x[token_idx]) * weights[token_idx, slot, None]
            routed.index_add_(0, token_idx, out.to(routed.dtype))
        return routed + self.shared_experts(x)
