"""How a model's KV cache is laid out: the KV-size formula and the KV cache groups.

One owner for both facts, because three services need them: the model-runner sizes its pool with
them, the kv-cache-manager keeps one block table per group, and the scheduler forwards the tables.

**KV bytes per token** (the seminar's formula)::

    GQA / MHA / MQA:  2 (K and V) x layers x kv_heads x head_dim x bytes per element
    MLA:              (latent_dim + rope_dim) x layers x bytes per element

**KV cache groups** (vLLM's hybrid KV cache manager): layers that attend alike share one block
table. A model whose layers all use full attention has one group of every layer, exactly the
classic layout. A model that mixes full and sliding-window layers (Qwen2/Qwen3 with
``use_sliding_window``, Gemma-style alternation) gets groups of equally many layers, each group all
full or all of one window, so that one block id means the same number of bytes in every group and
all groups draw from one pool::

    layer windows: [None, 16, None, 16]      (None = full attention)
    groups:        full (layers 0, 2) | window 16 (layers 1, 3)      2 layers per group

    pool tensor:   [layers_per_group, 2, num_blocks, block_size, kv_heads, head_dim]
    layer 2 is the 2nd layer of group 0: it reads pool[1] through group 0's block table

A window group's blocks that slid out of every query's window go back to the pool, which is where
the memory is saved; the full groups keep every block.

**Attention sinks** (StreamingLLM, opt-in, changes outputs; docs/kv_layout.md, "Attention sinks
(StreamingLLM)"): every layer in one window group that also keeps its first ``sink_tokens`` tokens.
Its dead blocks are then a *middle* range: the first ``ceil(sink_tokens / block_size)`` blocks never
die (:func:`dead_range`)::

    sink_tokens 4, window 8, block_size 4, a step starting at position 20:
    blocks:  [ 0-3 ][ 4-7 ][ 8-11 ][12-15][16-19][20-23]
              sink    dead   dead    live   live   live     (keys 13..20 are the window)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "INT4_GROUP", "KVGroup", "dead_blocks", "dead_range", "first_visible_key", "gqa_kv_bytes_per_token",
    "int4_group_size", "int4_row_bytes", "kv_groups", "layers_per_group", "mla_kv_bytes_per_token", "peak_blocks",
    "sink_blocks", "with_sinks",
]

INT4_GROUP = 32  # channels per INT4 scale (smaller heads use one group per head), see int4_group_size
INT4_SCALE_BYTES = 2  # one float16 scale per group


def int4_group_size(head_dim: int) -> int:
    """Channels sharing one INT4 scale: 32, or the whole head when it has fewer channels.

    WHY 32: a scale per 32 channels bounds each group's error by its own largest value, so one
    outlier channel costs 31 neighbours their precision rather than the whole head's 63 or 127
    (KIVI and QServe use groups of 32-128); its 2 scale bytes per 16 data bytes cost 1/9 of the
    INT4 page. It is also the size of the optional Hadamard rotation, which needs a power of two.

    Raises:
        ValueError: ``head_dim`` that the group does not divide, or a group that is not an even
            power of two (two nibbles per byte; Sylvester's Hadamard construction).
    """
    group = min(INT4_GROUP, head_dim)
    if head_dim % group or group < 2 or group & (group - 1):
        raise ValueError(f"INT4 KV needs head_dim a multiple of {INT4_GROUP} or a power of two >= 2, got {head_dim}")
    return group


def int4_row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an INT4 cache: ``head_dim / 2`` packed nibbles, then one
    float16 scale per group (``int4_group_size``): 36 for head_dim 64 (vs 128 in fp16)."""
    return head_dim // 2 + INT4_SCALE_BYTES * (head_dim // int4_group_size(head_dim))


def gqa_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """``2 x layers x kv_heads x head_dim x bytes``: K and V of one token across the whole model.

    ``bytes_per_element`` is a float so that packed formats count honestly: INT4 is
    ``int4_row_bytes(head_dim) / head_dim`` (0.5 for the nibbles plus its scales; 0.5625 at
    head_dim 64).
    """
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def mla_kv_bytes_per_token(num_layers: int, latent_dim: int, rope_dim: int, bytes_per_element: float) -> float:
    """``(latent_dim + rope_dim) x layers x bytes``: MLA caches one compressed latent and one shared
    rotary key per token and layer instead of per-head K and V."""
    return (latent_dim + rope_dim) * num_layers * bytes_per_element


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table.

    Attributes:
        window: the sliding window in tokens of every layer in the group (a query at position
            ``p`` sees keys ``p - window + 1 .. p``, as transformers' ``sliding_window``); None =
            full attention.
        layers: the model's layer indices, ascending; ``layers[j]`` lives in slot ``j`` of the
            pool's layer dimension.
        sink_tokens: attention sinks (StreamingLLM): a query also sees the first ``sink_tokens``
            tokens, whose blocks are never freed; 0 = none (only with a window, :func:`with_sinks`).
    """

    window: int | None
    layers: tuple[int, ...]
    sink_tokens: int = 0


def kv_groups(layer_windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """Partitions layers into KV cache groups of equal size (see the module docstring).

    The group size is the smallest number of layers sharing one window value, so every kind of
    attention fills whole groups where the counts divide, and the last group of a kind holds fewer
    layers (its unused slots are padding) where they do not. Full-attention groups come first,
    then window groups by ascending window.

    Raises:
        ValueError: no layers, or a window below 1.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window {window} must be >= 1 (None = full attention)")
        by_window.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in by_window.values())
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(
        KVGroup(window, tuple(by_window[window][start : start + size]))
        for window in order
        for start in range(0, len(by_window[window]), size)
    )


def layers_per_group(groups: Sequence[KVGroup]) -> int:
    """Slots in the pool's layer dimension: the largest group's size."""
    return max(len(group.layers) for group in groups)


def with_sinks(groups: Sequence[KVGroup], window: int, sink_tokens: int) -> tuple[KVGroup, ...]:
    """The attention-sinks layout of a model whose layers all use full attention: one group of every
    layer with ``window`` and ``sink_tokens`` (the pool slots stay those of the full layout).

    Raises:
        ValueError: some layer has a sliding window of its own, or a count below 1.
    """
    if window < 1 or sink_tokens < 1:
        raise ValueError(f"attention sinks need window >= 1 and sink_tokens >= 1, got {window} and {sink_tokens}")
    windowed = [g.window for g in groups if g.window is not None]
    if windowed:
        raise ValueError(f"attention sinks need every layer on full attention; this model has sliding windows "
                         f"{sorted(set(windowed))}")
    layers = tuple(sorted(layer for g in groups for layer in g.layers))
    return (KVGroup(window, layers, sink_tokens),)


def sink_blocks(sink_tokens: int, block_size: int) -> int:
    """Leading blocks that hold a sink token: ``ceil(sink_tokens / block_size)``; they never die."""
    return -(-sink_tokens // block_size)


def dead_range(window: int | None, sink_tokens: int, block_size: int, position: int) -> tuple[int, int]:
    """``(first, end)``: the blocks ``first .. end - 1`` of a group no query at ``position`` or
    later can see (empty when ``end == first``).

    Without sinks this is ``(0, dead_blocks(...))``. With sinks a block is dead when all its tokens
    are ``>= sink_tokens`` and ``< position - window + 1``, so the range starts after the sink blocks.
    """
    first = sink_blocks(sink_tokens, block_size) if window is not None else 0
    return first, max(first, dead_blocks(window, block_size, position))


def first_visible_key(position: int, window: int | None) -> int:
    """The first key a query at ``position`` sees: 0, or with a window ``position - window + 1``
    (transformers' ``sliding_window_overlay``: keys ``p - window < j <= p``)."""
    return 0 if window is None else max(0, position - window + 1)


def dead_blocks(window: int | None, block_size: int, position: int) -> int:
    """Leading blocks of a group that no query at ``position`` or later can see.

    A query at ``p`` sees keys ``p - window + 1 .. p``, so once a step starts at ``position`` every
    block whose tokens all lie below ``position - window + 1`` is dead: the kv-cache-manager frees
    it, and a prefix hit ending at ``position`` does not need it. A full group has none.
    """
    return first_visible_key(position, window) // block_size


def peak_blocks(window: int | None, block_size: int, num_tokens: int, max_step_tokens: int,
                sink_tokens: int = 0) -> int:
    """The most blocks one request of ``num_tokens`` tokens holds in one group at any step.

    A full group holds a block per ``block_size`` tokens. A window group, at a step that starts at
    ``p`` and schedules ``n <= max_step_tokens`` tokens, holds blocks ``dead_blocks(p)`` to
    ``ceil((p + n) / block_size) - 1``: the ``window - 1 + n`` tokens from the first visible key on,
    starting anywhere in a block, so at most ``ceil((window - 1 + n + block_size - 1) / block_size)``
    (at most one more than ``ceil((window - 1 + n) / block_size)``), plus ``sink_blocks(sink_tokens)``
    with attention sinks, and never more than the full count.
    """
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    span = -(-(window - 1 + max_step_tokens + block_size - 1) // block_size)
    return min(full, sink_blocks(sink_tokens, block_size) + span)
