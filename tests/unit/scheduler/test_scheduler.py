"""Exact scheduling decisions of the step planner, against the real in-process kv-cache-manager.

The runner's part (sampling) is played by ``_sample``: every request whose scheduled tokens reach
the end of its known tokens gets a token, exactly as the model-runner decides; the scheduler is the
component under test here.
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
from services.scheduler.request import FinishReason, Request, RequestSpec, RequestStatus
from services.scheduler.scheduler import ScheduledStep, Scheduler
from shared.hashing import BlockHash, hash_blocks, hash_seed
from shared.sampling_params import SamplingParams

EOS = 99
SEED = hash_seed(b"kvmesh-dev", "m")  # the scheduler's: it hashes, the manager never does


def _make(num_blocks: int, budget: int = 1024, max_seqs: int = 16, block_size: int = 16,
          prefix: bool = True) -> tuple[Scheduler, KVCacheManager]:
    manager = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=4096))
    info = RunnerInfo(model_id="m", vocab_size=1000, max_model_len=4096, eos_token_ids=(EOS,),
                      num_blocks=num_blocks, block_size=block_size)
    # The synchronous planner: async scheduling's slot reserve would change every block id below.
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_prefix_caching=prefix,
                          async_scheduling=False)
    return Scheduler(cfg, InProcessKVCache(manager), info, hash_seed=SEED), manager


def _req(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0) -> Request:
    spec = RequestSpec(request_id=rid, prompt_token_ids=tuple(prompt), sampling=SamplingParams(),
                       max_tokens=max_tokens, priority=priority)
    return Request(spec=spec, seq=0)


def _sample(sched: Scheduler, step: ScheduledStep, token: int = 7) -> StepOutput:
    sampled = []
    for rid, n in step.num_scheduled.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:
            sampled.append(SampledToken(rid, token))
    return StepOutput(step.step_input.step_id, tuple(sampled))


def _hashes(manager: KVCacheManager, tokens: list[int]) -> list[BlockHash]:
    """The scheduler's block hashes of ``tokens`` (no salt), which the manager keys on."""
    return hash_blocks(SEED, tokens, manager.config.block_size, b"")


def _run(sched: Scheduler, token: int = 7) -> ScheduledStep:
    step = sched.schedule()
    assert step is not None
    sched.update(step, _sample(sched, step, token))
    return step


def test_chunked_prefill_budget_split() -> None:
    """Three 800-token prompts with a 1024-token budget: 800, then 224, then the rest."""
    sched, manager = _make(num_blocks=200)
    for i, rid in enumerate("abc"):
        sched.add(_req(rid, [i * 1000 + j % 900 for j in range(800)]))
    s1 = _run(sched)
    assert s1.num_scheduled == {"a": 800, "b": 224}
    assert [r.request_id for r in s1.step_input.new_requests] == ["a", "b"]
    assert sched.requests["a"].output_token_ids == [7]  # a's prompt is complete: it sampled
    assert sched.requests["b"].output_token_ids == []  # partial chunk: nothing sampled
    s2 = _run(sched)
    # running first (a decodes 1, b finishes its prompt with 576), then c gets what is left.
    assert s2.num_scheduled == {"a": 1, "b": 576, "c": 1024 - 1 - 576}
    assert [r.request_id for r in s2.step_input.cached_requests] == ["a", "b"]
    s3 = _run(sched)
    assert s3.num_scheduled == {"a": 1, "b": 1, "c": 800 - 447}
    manager.check_integrity()


def test_decode_grows_block_table_at_block_boundary() -> None:
    sched, manager = _make(num_blocks=20)
    sched.add(_req("a", list(range(16)), max_tokens=4))
    s1 = _run(sched)
    assert s1.step_input.new_requests[0].block_ids == (1,)
    s2 = _run(sched)  # 17th token needs a second block
    assert s2.step_input.cached_requests[0].new_block_ids == (2,)
    s3 = _run(sched)
    assert s3.step_input.cached_requests[0].new_block_ids == ()
    assert sched.requests["a"].block_ids == [1, 2]
    manager.check_integrity()


def test_prefix_hit_skips_cached_tokens() -> None:
    sched, manager = _make(num_blocks=40)
    prompt = [*list(range(48)), 500, 501]
    sched.add(_req("a", prompt, max_tokens=1))
    _run(sched)  # a finishes after one token (max_tokens=1)
    assert "a" not in sched.requests
    sched.add(_req("b", [*list(range(48)), 600]))
    step = _run(sched)
    new = step.step_input.new_requests[0]
    assert new.num_computed_tokens == 48 and new.num_new_tokens == 1
    assert sched.requests["b"].num_cached_tokens == 48
    manager.check_integrity()


def test_prefix_caching_off_recomputes() -> None:
    sched, _ = _make(num_blocks=40, prefix=False)
    sched.add(_req("a", [*list(range(48)), 1], max_tokens=1))
    _run(sched)
    sched.add(_req("b", [*list(range(48)), 2]))
    step = _run(sched)
    assert step.step_input.new_requests[0].num_computed_tokens == 0


def test_preemption_picks_newest_and_recomputes_later() -> None:
    # 5 usable blocks of 4 tokens. a and b each hold 2 full blocks (8 tokens) after prefill.
    sched, manager = _make(num_blocks=6, block_size=4, budget=64)
    sched.add(_req("a", list(range(7)), max_tokens=12))
    sched.add(_req("b", list(range(100, 107)), max_tokens=12))
    _run(sched)  # both prefilled (7 tokens -> 2 blocks each), both sampled 1 token: 8 tokens
    assert sched.requests["a"].block_ids == [1, 2] and sched.requests["b"].block_ids == [3, 4]
    _run(sched)  # computes the 8th token: still 2 blocks each
    assert sched.requests["b"].status is RequestStatus.RUNNING
    _run(sched)  # 9th token: a takes block 5; b needs one too: none left -> b (newest) preempted
    assert sched.requests["b"].status is RequestStatus.WAITING
    assert sched.requests["b"].num_preemptions == 1
    assert sched.requests["a"].block_ids == [1, 2, 5]
    assert sched.num_preemptions == 1
    assert sched.requests["b"].output_token_ids == [7, 7]  # output so far is kept
    manager.check_integrity()
    # b is recomputed once a finishes; its whole sequence (prompt + output) is the new "prompt".
    while "a" in sched.requests:
        _run(sched)
    step = _run(sched)
    newb = step.step_input.new_requests[0]
    assert newb.request_id == "b" and newb.token_ids == (*range(100, 107), 7, 7)
    assert newb.num_prompt_tokens == 7
    manager.check_integrity()


def test_finish_frees_at_next_step_and_abort() -> None:
    sched, manager = _make(num_blocks=20)
    sched.add(_req("a", list(range(20)), max_tokens=50))
    _run(sched)
    assert manager.stats().num_free_blocks == 19 - 2
    assert sched.finish("a", FinishReason.ABORT)
    assert sched.schedule() is None
    assert sched.take_pending_frees() == (["a"], [])


def test_eos_and_stop_token_and_length() -> None:
    sched, _ = _make(num_blocks=20)
    sched.add(_req("a", [1, 2, 3], max_tokens=2))
    s = sched.schedule()
    assert s is not None
    events = sched.update(s, _sample(sched, s, token=EOS))
    assert events[0].finished and events[0].request.finish_reason is FinishReason.STOP
    sched.add(_req("b", [1, 2, 3], max_tokens=2))
    _run(sched)
    s = sched.schedule()
    assert s is not None
    events = sched.update(s, _sample(sched, s))
    assert events[0].finished and events[0].request.finish_reason is FinishReason.LENGTH


def test_priority_orders_waiting_queue() -> None:
    sched, _ = _make(num_blocks=20, max_seqs=1)
    sched.add(_req("low", [1, 2], priority=5))
    sched.add(_req("high", [3, 4], priority=0))
    step = _run(sched)
    assert list(step.num_scheduled) == ["high"]


def test_fcfs_when_first_waiting_does_not_fit() -> None:
    """A waiting request that does not fit blocks later ones, so it is not starved."""
    sched, manager = _make(num_blocks=6, block_size=4, budget=64)
    sched.add(_req("a", list(range(12)), max_tokens=4))  # 3 blocks
    _run(sched)
    sched.add(_req("big", list(range(100, 112)), max_tokens=4))  # needs 3 blocks; only 2 free
    sched.add(_req("small", [1], max_tokens=1))
    step = _run(sched)
    assert set(step.num_scheduled) == {"a"}
    assert sched.requests["small"].status is RequestStatus.WAITING
    manager.check_integrity()
    assert manager.stats().num_free_blocks == 5 - 4  # a has 4 blocks after its 13th token


def test_running_request_decodes_every_step_while_long_prompt_prefills() -> None:
    """Chunked prefill: a 400-token prompt is read 63 tokens a step; the running one never stalls."""
    sched, manager = _make(num_blocks=100, budget=64)
    sched.add(_req("short", [1, 2, 3], max_tokens=20))
    _run(sched)
    sched.add(_req("long", list(range(400)), max_tokens=2))
    chunks: list[int] = []
    while sum(chunks) < 400:
        step = _run(sched)
        assert step.num_scheduled["short"] == 1  # a token every step
        chunks.append(step.num_scheduled["long"])
    assert chunks == [63] * 6 + [400 - 63 * 6]
    assert len(sched.requests["short"].output_token_ids) == 1 + len(chunks)
    manager.check_integrity()


def test_request_released_in_the_step_that_allocated_it_leaves_no_cached_block() -> None:
    """FCFS release after allocation: the released request's full block was registered when it
    was allocated but never computed; it must not stay in the prefix cache, or the request's own
    readmission would "hit" uncomputed KV."""
    sched, manager = _make(num_blocks=6, block_size=4, budget=64)
    sched.add(_req("a", list(range(10)), max_tokens=2))  # 3 blocks
    _run(sched)
    sched.add(_req("big", list(range(100, 112)), max_tokens=1))  # needs 3 blocks; only 2 free
    small_prompt = [200, 201, 202, 203, 204]
    sched.add(_req("small", small_prompt, max_tokens=1))  # fits (2 blocks) but waits behind big
    step = _run(sched)
    assert set(step.num_scheduled) == {"a"}
    assert _hashes(manager, small_prompt)[0] not in manager.pool.cached
    assert manager.stats().num_cached_blocks == 2  # a's two full prompt blocks only
    manager.check_integrity()
    step = _run(sched)  # a finished: big and small are admitted together
    assert [(r.request_id, r.num_computed_tokens) for r in step.step_input.new_requests] == [
        ("big", 0), ("small", 0)]
    manager.check_integrity()


def test_running_request_preempted_after_its_slots_were_granted_is_rolled_back() -> None:
    """o (older) needs a block and finds none; n (newer) was granted its last prefill chunk, which
    completes a block, in the same call. n is preempted: the block it never computed is unregistered,
    so o's retry reuses it as a plain free block instead of evicting (and offloading) garbage."""
    sched, manager = _make(num_blocks=7, block_size=4, budget=8)
    sched.add(_req("o", list(range(6)), max_tokens=20))
    _run(sched)  # o: blocks 1, 2
    n_prompt = list(range(300, 316))
    sched.add(_req("n", n_prompt, max_tokens=4))
    s2 = _run(sched)  # o decodes; n reads 7 tokens into 3, 4
    assert s2.num_scheduled == {"o": 1, "n": 7}
    s3 = _run(sched)  # n reads 7 more into 5, 6: the pool is full
    assert s3.num_scheduled == {"o": 1, "n": 7}
    assert sched.requests["n"].block_ids == [3, 4, 5, 6]
    s4 = _run(sched)  # o needs a 3rd block; n's last 2 tokens (completing block 6) were granted
    assert s4.preempted == ["n"]
    assert s4.num_scheduled == {"o": 1}
    assert sched.requests["o"].block_ids == [1, 2, 6]
    assert manager.stats().num_evictions == 0
    n_hashes = _hashes(manager, n_prompt)
    assert [manager.pool.cached[h].block_id for h in n_hashes[:3]] == [3, 4, 5]
    assert n_hashes[3] not in manager.pool.cached
    manager.check_integrity()


def test_prefix_caching_off_says_the_offload_tier_is_unused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 13: turning prefix caching off used to drop the offload-store (and swap preemption)
    silently; the scheduler now says so once, and still works without it."""
    from services.offload_store.client import InProcessOffload
    from services.offload_store.config import OffloadConfig
    from services.scheduler.offload import OffloadConnector

    store = InProcessOffload(OffloadConfig(data_dir=str(tmp_path / "offload")))
    try:
        manager = KVCacheManager(CacheConfig(block_size=16, num_blocks=40, max_model_len=4096))
        info = RunnerInfo(model_id="m", vocab_size=1000, max_model_len=4096, eos_token_ids=(EOS,),
                          num_blocks=40, block_size=16)
        for prefix, expect_warning in ((True, False), (False, True)):
            caplog.clear()
            cfg = SchedulerConfig(enable_prefix_caching=prefix, preemption_mode="swap", async_scheduling=False)
            with caplog.at_level(logging.WARNING, logger="services.scheduler.scheduler"):
                sched = Scheduler(cfg, InProcessKVCache(manager), info, OffloadConnector(store),
                                  hash_seed=SEED)
            warned = [r.getMessage() for r in caplog.records if "offload-store is not used" in r.getMessage()]
            assert (sched.offload is None) == expect_warning
            assert warned == ([("prefix caching is off, so the offload-store is not used: no offload reloads, "
                                "and preemption_mode=swap falls back to recompute")] if expect_warning else [])
    finally:
        store.close()
