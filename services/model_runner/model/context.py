"""What one forward pass needs besides the tokens: the paged cache, its scales, the batch layout.

It is passed explicitly down the layers (never set as a global between them), so two forwards with
different caches, e.g. the real pool and a scratch fp32 cache for fp8 calibration, cannot mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.model_runner.attention.base import AttentionBackend, AttentionMetadata
from services.model_runner.attention.streaming import StreamingAttention


@dataclass(frozen=True)
class ForwardContext:
    """Per-forward state shared by every attention layer.

    Attributes:
        kv_cache: ``[layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim]`` pool
            tensor (``shared/kv_layout.py``).
        kv_scales: ``(k_scale, v_scale)`` per layer (1.0 unless the cache is fp8).
        meta: the flat batch layout (slots, query ranges, block tables) of KV cache group 0.
        backend: writes K/V and computes paged attention.
        kv_amax: ``[num_layers, 2]`` float32 running max of ``|K|`` / ``|V|``, updated in place when
            given (fp8 calibration); None in normal serving.
        group_metas: every KV cache group's metadata, in group order (``meta`` is the first);
            empty: one group, ``meta``.
        kv_rotation: ``[G, G]`` Hadamard matrix when the INT4 cache stores K/V rotated (the
            attention layers then rotate Q, K, V and the output, ``attention/int4.py``); else None.
        streaming: the attention-sinks mode's attention (``attention/streaming.py``): keys are
            then written unrotated and attended by it; None in every other mode.
        output_rows: ``[N]`` int64 rows, ascending (the native stack refuses others), whose final
            hidden states the caller reads (the rows a step samples from); the forward then
            returns those rows only, and a layer stack that can skips the last layer's work past
            the K/V writes for the others (``native/decode_stack.c``). None: every row.
    """

    kv_cache: torch.Tensor
    kv_scales: Sequence[tuple[float, float]]
    meta: AttentionMetadata
    backend: AttentionBackend
    kv_amax: torch.Tensor | None = None
    group_metas: tuple[AttentionMetadata, ...] = ()
    kv_rotation: torch.Tensor | None = None
    streaming: StreamingAttention | None = None
    output_rows: torch.Tensor | None = None

    def group_meta(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group`` (its block tables, slots and window)."""
        if not self.group_metas:
            if group != 0:
                raise IndexError(f"KV cache group {group}: this forward has one group")
            return self.meta
        return self.group_metas[group]
