"""The scheduler with several KV cache groups, against the real in-process kv-cache-manager.

A hybrid model (one full group, one window group of 32 tokens) with blocks of 16: the runner gets
block ids group-major (a new request's two tables, a running request's two runs of new ids), the
scheduler keeps one table per group, admission counts a window group's blocks as the window it
holds, and the offload tier is off (said once). The runner's part (sampling) is ``_sample``, as in
test_scheduler.py: the scheduler is the component under test.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.kv_cache_manager.client import InProcessKVCache
from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.manager import KVCacheManager
from services.model_runner.client import RunnerInfo
from services.model_runner.types import SampledToken, StepOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request, RequestSpec
from services.scheduler.scheduler import ScheduledStep, Scheduler
from services.scheduler.validation import validate_request
from shared.errors import InvalidArgument
from shared.hashing import hash_seed
from shared.sampling_params import SamplingParams

EOS = 99
SEED = hash_seed(b"kvmesh-dev", "m")
HYBRID = (None, 32)


def _info(num_blocks: int, windows: tuple[int | None, ...] = HYBRID) -> RunnerInfo:
    return RunnerInfo(model_id="m", vocab_size=1000, max_model_len=4096, eos_token_ids=(EOS,),
                      num_blocks=num_blocks, block_size=16, kv_group_windows=windows)


def _make(num_blocks: int, budget: int, windows: tuple[int | None, ...] = HYBRID) -> tuple[Scheduler, KVCacheManager]:
    manager = KVCacheManager(CacheConfig(block_size=16, num_blocks=num_blocks, max_model_len=4096,
                                         group_windows=windows))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, async_scheduling=False)
    return Scheduler(cfg, InProcessKVCache(manager), _info(num_blocks, windows), hash_seed=SEED), manager


def _req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    spec = RequestSpec(request_id=rid, prompt_token_ids=tuple(prompt), sampling=SamplingParams(), max_tokens=max_tokens)
    return Request(spec=spec, seq=0)


def _run(sched: Scheduler, token: int = 7) -> ScheduledStep:
    step = sched.schedule()
    assert step is not None
    sampled = [SampledToken(rid, token) for rid, n in step.num_scheduled.items()
               if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens]
    sched.update(step, StepOutput(step.step_input.step_id, tuple(sampled)))
    return step


A = list(range(100))  # 6 full blocks + 4 tokens


def test_chunked_prefill_sends_group_major_ids_and_a_prefix_hit_needs_only_the_window() -> None:
    sched, manager = _make(num_blocks=31, budget=48)
    sched.add(_req("a", A))
    s1 = _run(sched)
    assert s1.step_input.new_requests[0].block_ids == (1, 2, 3, 4, 5, 6)
    # At 48 the window group's block 4 (tokens 0..15) is dead: freed, so it is not in the new run.
    s2 = _run(sched)
    assert s2.step_input.cached_requests[0].new_block_ids == (7, 8, 9, 10, 11, 12)
    s3 = _run(sched)
    assert (s3.num_scheduled, s3.step_input.cached_requests[0].new_block_ids) == ({"a": 4}, (13, 14))
    a = sched.requests["a"]
    # The scheduler's tables keep the dead ids (nobody reads them); the manager's has the null block.
    assert a.block_tables == [[1, 2, 3, 7, 8, 9, 13], [4, 5, 6, 10, 11, 12, 14]]
    assert list(manager.get_block_table("a").block_ids) == [1, 2, 3, 7, 8, 9, 13, 0, 0, 0, 0, 11, 12, 14]
    assert a.output_token_ids == [7]
    sched.add(_req("b", A))
    s4 = _run(sched)
    new_b = s4.step_input.new_requests[0]
    assert (new_b.block_ids, new_b.num_computed_tokens, s4.num_scheduled) == (
        (1, 2, 3, 7, 8, 9, 15, 0, 0, 0, 0, 11, 12, 16), 96, {"a": 1, "b": 4})
    assert sched.requests["b"].num_cached_tokens == 96
    manager.check_integrity()


def test_a_window_model_preempts_by_recompute_and_resumes_from_its_window() -> None:
    sched, manager = _make(num_blocks=15, budget=1024)
    sched.add(_req("a", list(range(48)), max_tokens=30))
    sched.add(_req("b", list(range(500, 548)), max_tokens=30))
    first = _run(sched)
    assert [r.block_ids for r in first.step_input.new_requests] == [(1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)]
    preempted: list[str] = []
    resumed = []
    while sched.has_work:
        step = _run(sched)
        preempted += step.preempted
        resumed += [(step.step_input.step_id, r.block_ids, r.num_computed_tokens) for r in step.step_input.new_requests]
        manager.check_integrity()
    # 2 x 6 blocks fill 12 of 14; window freeing lets both grow past 48 tokens (each decode's new
    # window block reuses the one that died), but at 64 the full group needs a block more than the
    # window gives back: b (the newest) gives way once, at step 18, and resumes once a finished
    # (step 31) from its 64 computed tokens: full blocks 7, 8, 9, 4 and the window's last two.
    assert preempted == ["b"]
    assert resumed == [(31, (7, 8, 9, 4, 11, 0, 0, 12, 10, 5), 64)]
    assert sched.requests == {}
    stats = manager.free(*sched.take_pending_frees())  # what an idle engine flushes
    assert (stats.num_requests, stats.num_free_blocks) == (0, 14)
    assert (stats.recompute_queries, stats.recompute_hits) == (65, 64)  # 48 prompt + 17 output tokens


def test_admission_counts_a_window_group_as_the_window_it_holds() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=False)
    window_only = _info(11, (32,))
    # 1,000 tokens need 63 blocks with full attention; a window of 32 never holds more than 7.
    validate_request(A, SamplingParams(), 900, window_only, config)
    with pytest.raises(InvalidArgument, match="needs 70 KV blocks but the whole pool has 10"):
        validate_request(A, SamplingParams(), 900, _info(11, HYBRID), config)
    with pytest.raises(InvalidArgument, match="needs 63 KV blocks but the whole pool has 10"):
        validate_request(A, SamplingParams(), 900, _info(11, (None,)), config)


def test_the_offload_tier_is_off_for_a_window_model_and_says_so(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from services.offload_store.client import InProcessOffload
    from services.offload_store.config import OffloadConfig
    from services.scheduler.offload import OffloadConnector

    store = InProcessOffload(OffloadConfig(data_dir=str(tmp_path / "offload")))
    try:
        manager = KVCacheManager(CacheConfig(block_size=16, num_blocks=40, group_windows=HYBRID))
        cfg = SchedulerConfig(preemption_mode="swap", role="prefill")
        with caplog.at_level(logging.WARNING, logger="services.scheduler.scheduler"):
            sched = Scheduler(cfg, InProcessKVCache(manager), _info(40), OffloadConnector(store), hash_seed=SEED)
            sched.bind_runner(_info(40))  # a re-bind to the same model: not said again
        assert sched.offload is None
        assert [r.getMessage() for r in caplog.records] == [
            "the model has sliding-window KV cache groups (windows [32]), so the offload-store is not used: "
            "no offload reloads, no prefill publishing (P/D), and preemption_mode=swap falls back to recompute"]
        sched.bind_runner(_info(40, (None,)))  # the same store serves an all-full model
        assert sched.offload is not None
    finally:
        store.close()
