"""KV memory one request holds at the end of a long request: sliding-window groups vs full attention.

The real kv-cache-manager core, no model: one request of ``--times`` x the window (default 4x) is
prefilled in chunks of ``--chunk`` tokens, then decodes its last ``--decode`` tokens one step at a
time, exactly as the scheduler drives it; at the end the blocks it holds are counted per group
(pool usage) and turned into bytes with each group's block size (shared/kv_layout.py: layers per
group x the KV-size formula x block size). The full-attention equivalent is the same model with
every layer full: one group, one block per ``block_size`` tokens of every layer.

Run: ``python bench/kvm_window_blocks.py``; prints a markdown table (docs/design.md has it). The
runner side's ``bench/kv_window_memory.py`` derives the same figures from the formula and real pools.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationSpec
from shared.hashing import hash_blocks, hash_seed
from shared.kv_layout import gqa_kv_bytes_per_token, kv_groups, layers_per_group

SEED = hash_seed(b"bench", "window-memory")


@dataclass(frozen=True)
class Layout:
    """A model's attention layout (the shape of a real checkpoint's config)."""

    name: str
    layer_windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int
    bytes_per_element: float


def layouts() -> list[Layout]:
    """Shapes of public configs (no weights): Mistral-7B-v0.1, a Qwen2-7B with half its layers in
    the window (``max_window_layers=14``), Gemma-3-4B's 5 local : 1 global, and the tests' tiny one."""
    gemma3 = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    return [
        Layout("Mistral-7B-v0.1 (32 layers, all window 4096)", (4096,) * 32, 8, 128, 2),
        Layout("Qwen2-7B, max_window_layers=14 (14 full + 14 window 4096)", (None,) * 14 + (4096,) * 14, 4, 128, 2),
        Layout("Gemma-3-4B-like (29 window 1024, 5 full)", gemma3, 4, 256, 2),
        Layout("tests' tiny hybrid (2 full + 2 window 16, fp32)", (None, None, 16, 16), 2, 16, 4),
    ]


def held_blocks(windows: tuple[int | None, ...], block_size: int, num_tokens: int, chunk: int,
                decode: int) -> list[int]:
    """Blocks one request holds per group after its last step (the manager's own tables)."""
    prompt = list(range(num_tokens - decode))
    tokens = [t % 30000 for t in prompt]
    need = -(-num_tokens // block_size) * len(windows) + 1
    m = KVCacheManager(CacheConfig(num_blocks=need + 1, block_size=block_size, max_model_len=num_tokens,
                                   group_windows=windows))
    hashes = hash_blocks(SEED, tokens, block_size, b"")
    m.step((), [AllocationSpec("r", tuple(tokens), min(chunk, len(tokens)), is_new=True, block_hashes=tuple(hashes))])
    done = min(chunk, len(tokens))
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        m.step((), [AllocationSpec("r", (), n)])
        done += n
    for i in range(decode):
        token = 7 + i
        tokens.append(token)
        fresh = hash_blocks(SEED, tokens, block_size, b"")[len(hashes):]
        hashes += fresh
        m.step((), [AllocationSpec("r", (token,), 1, block_hashes=tuple(fresh))])
    m.check_integrity()
    table = m.get_block_table("r").block_ids
    n = len(table) // len(windows)
    return [sum(1 for b in table[g * n : (g + 1) * n] if b) for g in range(len(windows))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=int, default=4, help="request length in windows (the largest window)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step (the token budget)")
    parser.add_argument("--decode", type=int, default=16, help="tokens decoded one step at a time at the end")
    args = parser.parse_args()
    bs = args.block_size
    print("| model | tokens | groups (window x layers) | blocks held | KV held | full attention | ratio |")
    print("|---|---|---|---|---|---|---|")
    for lay in layouts():
        window = max(w for w in lay.layer_windows if w is not None)
        num_tokens = args.times * window
        groups = kv_groups(lay.layer_windows)
        slots = layers_per_group(groups)
        windows = tuple(g.window for g in groups)
        block_bytes = gqa_kv_bytes_per_token(slots, lay.kv_heads, lay.head_dim, lay.bytes_per_element) * bs
        held = held_blocks(windows, bs, num_tokens, min(args.chunk, window * args.times), args.decode)
        kv = sum(held) * block_bytes
        full_bytes = -(-num_tokens // bs) * bs * gqa_kv_bytes_per_token(
            len(lay.layer_windows), lay.kv_heads, lay.head_dim, lay.bytes_per_element)
        shape = " + ".join(f"{'full' if g.window is None else g.window} x {len(g.layers)}" for g in groups)
        print(f"| {lay.name} | {num_tokens} | {shape} | {held} | {kv / 2**20:.2f} MiB | {full_bytes / 2**20:.2f} MiB "
              f"| {kv / full_bytes:.3f} |")


if __name__ == "__main__":
    main()
