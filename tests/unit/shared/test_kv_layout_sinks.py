"""shared/kv_layout.py's attention-sinks facts: the sinks group, the dead middle, the peak blocks."""

from __future__ import annotations

import pytest

from shared.kv_layout import KVGroup, dead_range, kv_groups, peak_blocks, sink_blocks, with_sinks


def test_with_sinks_makes_one_window_group_of_every_layer_or_refuses() -> None:
    assert with_sinks(kv_groups([None] * 3), 16, 4) == (KVGroup(16, (0, 1, 2), 4),)
    with pytest.raises(ValueError, match=r"sliding windows \[8\]"):
        with_sinks(kv_groups([None, 8]), 16, 4)
    with pytest.raises(ValueError, match="window >= 1 and sink_tokens >= 1"):
        with_sinks(kv_groups([None]), 16, 0)


def test_dead_range_starts_after_the_sink_blocks() -> None:
    assert sink_blocks(4, 4) == 1 and sink_blocks(5, 4) == 2 and sink_blocks(0, 4) == 0
    # k 4, W 8, bs 4, a step at 20: keys 13..20 are the window, so blocks 1 and 2 (tokens 4..11) are dead.
    assert dead_range(8, 4, 4, 20) == (1, 3)
    assert dead_range(8, 0, 4, 20) == (0, 3)  # no sinks: the leading run
    assert dead_range(8, 4, 4, 8) == (1, 1)  # nothing dead yet
    assert dead_range(8, 6, 4, 20) == (2, 3)  # block 1 holds sinks 4, 5
    assert dead_range(None, 0, 4, 100) == (0, 0)


def test_peak_blocks_counts_the_sink_blocks() -> None:
    # ceil(k / bs) + ceil((W - 1 + n + bs - 1) / bs), at most the full count
    assert peak_blocks(16, 4, 1000, 8, 4) == 1 + 7
    assert peak_blocks(16, 4, 1000, 8) == 7
    assert peak_blocks(16, 4, 12, 8, 4) == 3


@pytest.mark.parametrize(("window", "sinks", "bs", "chunk"), [
    (16, 4, 4, 8), (14, 0, 4, 1), (14, 5, 4, 1), (5, 3, 4, 3), (32, 20, 16, 16), (1, 1, 4, 1), (13, 0, 4, 2),
])
def test_peak_blocks_is_the_most_any_step_holds_with_sinks(window: int, sinks: int, bs: int, chunk: int) -> None:
    """Every step start p and size n <= chunk, by the rule spelled out: the blocks with a token the
    step's queries can see (j < sinks, or p - window + 1 <= j < p + n). (14, 0, 4, 1) is a window
    straddling two block boundaries: tokens 3..16 are 5 blocks."""
    num_tokens = 30 * bs + window + chunk + sinks
    most = max(len({j // bs for j in range(p + n) if j < sinks or j >= p - window + 1})
               for p in range(num_tokens) for n in range(1, min(chunk, num_tokens - p) + 1))
    assert peak_blocks(window, bs, num_tokens, chunk, sinks) == most
