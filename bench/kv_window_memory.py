"""KV memory of one request at 4x the sliding window, against the full-attention equivalent.

Two ways, which must agree: from the formula (``shared/kv_layout.py``: full layers hold every
token, window layers their last ``window`` tokens), and from real pools (``KVPool`` built for each
model's KV cache groups: the blocks a request still holds when its next token is decoded, as the
kv-cache-manager keeps them, times the pool's bytes per block; and the same model as one group of
full attention). Block granularity makes the pool figure a little larger than the formula.

    PYTHONPATH=$PWD python bench/kv_window_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.model_runner.kv_pool import KVPool
from services.model_runner.model.config import ModelConfig
from shared.kv_layout import dead_blocks, gqa_kv_bytes_per_token, layers_per_group

BASE: dict[str, Any] = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4}
MODELS: dict[str, tuple[dict[str, Any], int, torch.dtype]] = {  # config, block size, KV dtype
    "tiny Mistral (test), window 16": ({**BASE, "architectures": ["MistralForCausalLM"], "num_hidden_layers": 2,
                                        "num_key_value_heads": 2, "sliding_window": 16}, 4, torch.float32),
    "tiny Qwen2 alternating (test), window 24": (
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "num_key_value_heads": 2,
         "use_sliding_window": True, "sliding_window": 24,
         "layer_types": ["sliding_attention", "full_attention"] * 2}, 4, torch.float32),
    "Mistral-7B-v0.1 geometry, window 4096": (
        {**BASE, "architectures": ["MistralForCausalLM"], "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "sliding_window": 4096, "max_position_embeddings": 32768},
        16, torch.bfloat16),
    "Qwen2-7B geometry, alternating layers, window 4096": (
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28, "num_attention_heads": 28,
         "num_key_value_heads": 4, "head_dim": 128, "use_sliding_window": True, "sliding_window": 4096,
         "max_position_embeddings": 32768, "layer_types": ["sliding_attention", "full_attention"] * 14},
        16, torch.bfloat16),
}  # fmt: skip


def _pool(cfg: ModelConfig, block_size: int, dtype: torch.dtype, slots: int) -> KVPool:
    per_block = int(block_size * gqa_kv_bytes_per_token(slots, cfg.num_kv_heads, cfg.head_dim, dtype.itemsize))
    return KVPool(num_layers=cfg.num_layers, layer_slots=slots, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  block_size=block_size, memory_bytes=2 * per_block, dtype=dtype, name="kvmesh-bench")  # fmt: skip


def measure(hf: dict[str, Any], block_size: int, dtype: torch.dtype) -> dict[str, float]:
    cfg = ModelConfig.from_hf_dict(hf)
    groups = cfg.kv_groups
    window = min(g.window for g in groups if g.window is not None)
    length = 4 * window  # tokens in the cache, the last one's query (position length - 1) attending now
    blocks = -(-length // block_size)
    held = sum(blocks - dead_blocks(g.window, block_size, length - 1) for g in groups)
    per_token = gqa_kv_bytes_per_token  # the formula, per layer kind
    formula = sum(
        per_token(1, cfg.num_kv_heads, cfg.head_dim, dtype.itemsize) * min(length, w or length)
        for w in cfg.layer_windows
    )
    formula_full = per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype.itemsize) * length
    with _pool(cfg, block_size, dtype, layers_per_group(groups)) as grouped, \
            _pool(cfg, block_size, dtype, cfg.num_layers) as full:  # fmt: skip
        return {
            "tokens": length, "groups": len(groups), "formula": formula, "formula_full": formula_full,
            "pool": held * grouped.bytes_per_block, "pool_full": blocks * full.bytes_per_block,
            "blocks": held, "blocks_full": blocks,
        }  # fmt: skip


def main() -> None:
    print("| model | tokens | groups | formula: window / full | pool: blocks x bytes, window / full | saved |")
    print("|---|---|---|---|---|---|")
    for name, (hf, block_size, dtype) in MODELS.items():
        m = measure(hf, block_size, dtype)
        print(f"| {name} | {m['tokens']:.0f} | {m['groups']:.0f} | {m['formula']:,.0f} / {m['formula_full']:,.0f} B "
              f"| {m['blocks']:.0f} / {m['blocks_full']:.0f} blocks = {m['pool']:,.0f} / {m['pool_full']:,.0f} B "
              f"| {1 - m['pool'] / m['pool_full']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
