"""The torch backend with MLA: paged attention over cached latents (``model/mla.py``).

An MLA layer caches one plane per token, ``[c_KV | k_rope]`` (``pool[layer, 0]`` is
``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``). Attention plans the step exactly as the
GQA path does (the same decode groups and prefill chunks, ``torch_backend.py``) and gathers each
group's latents the same way; the layer's ``expand`` then up-projects them to per-head K and V
(``kv_b_proj``) right before SDPA. K is ``nope + rope`` wide and V ``v_head_dim``: SDPA takes the
two widths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.torch_backend import TorchAttentionBackend, causal_chunk, store


class TorchMLABackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend` plus ``write_latent`` / ``forward_mla`` (``model/mla.py``'s
    ``MLABackend``); GQA models run on it unchanged."""

    def write_latent(self, entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     scale: float = 1.0) -> None:
        """Stores ``entry`` ``[T, 1, C]`` at its slots of ``cache`` ``[blocks, block_size, 1, C]``;
        rows whose slot is -1 (padding) are not written."""
        keep, slots = self._write_rows(slot_mapping)
        store(cache, entry if keep is None else entry[keep], slots, scale)

    def forward_mla(
        self,
        query: torch.Tensor,  # [T, H, Dk]
        cache: torch.Tensor,  # [num_blocks, block_size, 1, C]
        meta: AttentionMetadata,
        softmax_scale: float,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        v_dim: int,
        scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, Dv]
        """Causal attention of each sequence's query rows over its first ``seq_lens[i]`` cached
        entries, expanded to K/V by ``expand`` (``[..., S, C]`` -> ``[..., S, H, Dk]``, ``[..., S, H, Dv]``)."""
        plan = self._plan_for(meta, cache)
        out = query.new_empty(query.shape[0], query.shape[1], v_dim)
        for group in plan.decodes:
            rows = group.rows if group.rows is not None else slice(group.first, group.first + group.count)
            entries = self._gather(cache, group.block_ids, group.max_len, query.dtype, scale, 0)  # [n, S, 1, C]
            k, v = expand(entries[:, :, 0])  # [n, S, H, Dk], [n, S, H, Dv]
            out[rows] = F.scaled_dot_product_attention(
                query[rows].unsqueeze(2),  # [n, H, 1, Dk]
                k.transpose(1, 2),  # [n, H, S, Dk]
                v.transpose(1, 2),  # [n, H, S, Dv]
                attn_mask=group.mask,  # [n, 1, 1, S], None when no sequence is shorter than S
                scale=softmax_scale,
            ).squeeze(2)  # [n, H, Dv]
        for chunk in plan.chunks:
            entries = self._gather(cache, chunk.block_ids, chunk.seq_len, query.dtype, scale, 0)[0]  # [S, 1, C]
            k, v = expand(entries[:, 0])  # [S, H, Dk], [S, H, Dv]
            out[chunk.start : chunk.end] = causal_chunk(query[chunk.start : chunk.end], k, v, softmax_scale)
        return out
