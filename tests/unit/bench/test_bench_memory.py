"""KV memory figures from pool samples: occupancy at the peak, paged vs contiguous concurrency."""

from __future__ import annotations

from bench.serve.memory import PoolSample, memory_report


def test_occupancy_and_capacity_by_hand() -> None:
    samples = [
        PoolSample(running=2, tokens=40, blocks=3),
        PoolSample(running=3, tokens=100, blocks=8),
        PoolSample(running=4, tokens=90, blocks=7),
    ]
    m = memory_report(
        samples,
        preemptions=0,
        block_size=16,
        num_blocks=729,
        usable_blocks=728,
        max_model_len=8192,
        workload_max_len=192,
    )
    assert (m.peak_blocks, m.peak_tokens, m.peak_running_at_peak_blocks) == (8, 100, 3)
    assert m.occupancy == 100 / 128
    assert m.contiguous_occupancy == 100 / (3 * 8192)
    assert m.max_running_observed == 4
    assert m.paged_capacity == 728 // 12  # 192 tokens = 12 blocks per request
    assert m.contiguous_capacity == 729 * 16 // 8192


def test_no_samples_gives_zeros() -> None:
    m = memory_report([], 0, 16, 10, 9, 512, 0)
    assert (m.occupancy, m.contiguous_occupancy, m.paged_capacity, m.max_running_observed) == (0.0, 0.0, 0, 0)
