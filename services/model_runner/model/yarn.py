"""YaRN rotary frequencies and MLA's softmax scale, as transformers computes them for DeepSeek-V3.

DeepSeek-V3 extends its context with YaRN (``rope_type: yarn``, factor 40): the low frequencies
are interpolated, the high ones kept, with a linear ramp between the two correction dimensions,
and cos/sin are multiplied by an attention factor. The softmax scale gets ``mscale(factor,
mscale_all_dim)**2`` on top of ``1/sqrt(qk_head_dim)`` (``yarn_apply_mscale``). Both follow
``transformers.modeling_rope_utils._compute_yarn_parameters`` step by step, so the fp32 tables are
bitwise transformers'.
"""

from __future__ import annotations

import math

import torch

from services.model_runner.model.config import RopeConfig
from services.model_runner.model.mla_config import yarn_get_mscale


def yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """``([dim / 2] float32 inverse frequencies, attention factor)`` for ``rope.rope_type == "yarn"``."""
    yarn = rope.yarn
    if yarn is None:
        raise ValueError("yarn_inv_freq needs a rope config of type yarn")
    base, factor = rope.theta, rope.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, yarn.mscale) / yarn_get_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled rope."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.yarn is not None and rope.yarn.mscale_all_dim:
        mscale = yarn_get_mscale(rope.factor, rope.yarn.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale
