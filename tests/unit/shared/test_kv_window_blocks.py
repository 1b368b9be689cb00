"""shared/kv_layout.py's window arithmetic: which blocks are dead, and the most a request holds."""

from __future__ import annotations

import pytest

from shared.kv_layout import dead_blocks, peak_blocks


def test_dead_blocks_follow_transformers_window_rule() -> None:
    # Window 32, blocks of 16: a step at 48 sees keys 17..; block 0 (0..15) is dead, block 1 (16..31) not.
    assert [dead_blocks(32, 16, p) for p in (0, 31, 46, 47, 48, 63, 64, 96)] == [0, 0, 0, 1, 1, 2, 2, 4]
    assert dead_blocks(None, 16, 10_000) == 0  # full attention keeps everything
    assert dead_blocks(1, 4, 9) == 2  # window 1: only the query's own key (in block 2) is live


@pytest.mark.parametrize(("window", "bs", "chunk"), [(32, 16, 512), (16, 4, 32), (5, 4, 3), (1, 4, 1), (64, 16, 1)])
def test_peak_blocks_is_the_most_any_step_holds(window: int, bs: int, chunk: int) -> None:
    """Every step start p and size n <= chunk, by the rule spelled out: a step holds the blocks from
    its first query's first visible key (p - window + 1) to its last token."""
    num_tokens = 40 * bs + window + chunk
    most = max(-(-(p + n) // bs) - max(0, p - window + 1) // bs
               for p in range(num_tokens) for n in range(1, min(chunk, num_tokens - p) + 1))
    assert peak_blocks(window, bs, num_tokens, chunk) == most
    assert peak_blocks(None, bs, num_tokens, chunk) == -(-num_tokens // bs)
    assert peak_blocks(window, bs, 3, chunk) == 1  # never more than the request's own blocks
