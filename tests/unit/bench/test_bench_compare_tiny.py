"""``bench compare`` end to end on the tiny checkpoint: in-process engine and both transformers peers.

The suite (processes) is left out to keep this a unit test; every system must produce the same
greedy tokens, or the comparison would not compare the same work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve.compare import CompareConfig, run_compare
from bench.serve.docs import render


@pytest.mark.slow
def test_compare_runs_every_local_system_on_the_same_work(tiny_llama_dir: Path) -> None:
    cfg = CompareConfig(
        model_dir=str(tiny_llama_dir),
        num_prompts=3,
        input_len=12,
        output_len=5,
        repeats=1,
        systems=("inprocess", "hf-static", "hf-cb"),
        prefix_prompt_len=48,
        prefix_requests=1,
        kv_cache_memory_bytes=1 << 20,
        progress=False,
    )
    result = run_compare(cfg)
    assert set(result.throughput) == {"inprocess", "hf-static", "hf-cb"}
    assert all(s.median > 0 for s in result.throughput.values())
    assert result.identical_to_reference == {"inprocess": 3, "hf-static": 3, "hf-cb": 3}
    assert result.prefix_ttft_on_ms is not None and result.prefix_ttft_off_ms is not None
    assert result.prefix_hit_rate_on > 0.5  # 43 shared tokens = 2 full blocks of 16 out of 48
    memory = result.memory
    assert memory is not None and memory.preemptions == 0
    assert 0 < memory.occupancy <= 1 and memory.peak_running_at_peak_blocks >= 1
    assert "| kvmesh in-process engine |" in render(result)
