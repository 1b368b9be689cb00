"""A reference implementation of StreamingLLM's cache rule (Xiao et al., 2023), for tests only.

Written on a transformers Llama-family model's own modules (its projections, norms, MLP and rotary
embedding), one token at a time over a dense list cache, so that nothing of kvmesh's paged
machinery is in it: the oracle for kvmesh's attention-sinks mode.

The rule, per layer, when the token at text position ``p`` is processed:

- the cache keeps the first ``sink_tokens`` tokens and the last ``window`` tokens (``p`` itself
  included); every other token is dropped;
- keys are cached *before* rotary; at each step the kept keys get positions ``0 .. n-1`` by their
  place in the cache, and the query gets ``n-1`` (the paper: "positions within the cache rather
  than those in the original text"), so no relative distance ever exceeds the cache size.

Until ``p`` reaches ``sink_tokens + window`` nothing is dropped and every position equals the
text position: the outputs are then exactly the model's own.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv


@torch.no_grad()
def streaming_generate(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                       sink_tokens: int, window: int) -> list[int]:
    """Greedy tokens after ``prompt`` under the rule above (prompt tokens fed one by one)."""
    caches: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in model.model.layers]  # (text pos, k, v)
    out: list[int] = []
    token = prompt[0]
    for p in range(len(prompt) + max_new_tokens - 1):
        logits = _step(model, caches, token, p, sink_tokens, window)
        if p + 1 < len(prompt):
            token = prompt[p + 1]
        else:
            token = int(logits.argmax())
            out.append(token)
    return out


def _step(model: PreTrainedModel, caches: list[list[tuple[int, torch.Tensor, torch.Tensor]]],
          token: int, p: int, sink_tokens: int, window: int) -> torch.Tensor:
    decoder = model.model
    x = decoder.embed_tokens(torch.tensor([[token]]))  # [1, 1, hidden]
    for layer, cache in zip(decoder.layers, caches, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        head_dim = attn.head_dim
        q = attn.q_proj(h).view(1, 1, -1, head_dim).transpose(1, 2)  # [1, H, 1, D]
        k = attn.k_proj(h).view(1, 1, -1, head_dim).transpose(1, 2)  # [1, KV, 1, D]
        v = attn.v_proj(h).view(1, 1, -1, head_dim).transpose(1, 2)
        cache.append((p, k, v))
        cache[:] = [e for e in cache if e[0] < sink_tokens or e[0] > p - window]
        n = len(cache)
        keys = torch.cat([e[1] for e in cache], dim=2)  # [1, KV, n, D], unrotated
        values = torch.cat([e[2] for e in cache], dim=2)
        cos, sin = decoder.rotary_emb(values, torch.arange(n).unsqueeze(0))  # [1, n, D]
        q_rot, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
        _, k_rot = apply_rotary_pos_emb(keys, keys, cos, sin)
        groups = attn.num_key_value_groups
        scores = q_rot @ repeat_kv(k_rot, groups).transpose(2, 3) * attn.scaling  # [1, H, 1, n]
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        ctx = (probs @ repeat_kv(values, groups)).transpose(1, 2).reshape(1, 1, -1)
        x = x + attn.o_proj(ctx)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(decoder.norm(x))[0, -1]
