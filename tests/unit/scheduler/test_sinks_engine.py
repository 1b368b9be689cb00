"""Attention sinks end to end: the scheduler, the kv-cache-manager and the runner, in one process.

The engine is built as the service builds it (the runner from its config through ``build_runner``,
the kv-cache-manager bound from the runner's ``ModelInfo`` by the engine's binding); the steps are
driven here, one at a time, so that the pool is inspected after every one (and the engine thread
once, at the end). A pool of 12 blocks of 4 tokens (48 tokens) serves a
stream of 560: the live blocks are asserted exactly at every step, and the greedy tokens equal the
StreamingLLM reference (``tests/unit/model_runner/streaming_reference.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.kv_cache_manager.client import InProcessKVCache
from services.model_runner.client import InProcessRunner, RunnerInfo
from services.model_runner.config import RunnerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.inprocess import InProcessSuite
from services.scheduler.request import Request, RequestSpec
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.validation import validate_request
from shared.errors import InvalidArgument
from shared.sampling_params import SamplingParams
from tests.unit.model_runner.conftest import build_checkpoint
from tests.unit.model_runner.streaming_reference import streaming_generate

SINKS, WINDOW, BS, BUDGET = 4, 16, 4, 8
BYTES_PER_BLOCK = 3 * 2 * BS * 2 * 16 * 4  # tiny llama: 3 layers, K and V, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("sinks-llama"), "llama")


@pytest.fixture(scope="module")
def hf(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _suite(folder: Path, num_blocks: int) -> InProcessSuite:
    rc = RunnerConfig(model_dir=str(folder), block_size=BS, kv_cache_memory_bytes=num_blocks * BYTES_PER_BLOCK,
                      warmup=False, dtype="float32", streaming_sinks=SINKS, streaming_window=WINDOW)
    runner, kv = InProcessRunner.from_config(rc), InProcessKVCache()
    # Synchronous: the exact live-block counts below leave out async scheduling's slot reserve.
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4, async_scheduling=False)
    engine = Engine(config, kv, runner)  # bound, not started
    return InProcessSuite(engine, kv, runner, None)


@pytest.fixture
def small(folder: Path) -> Iterator[InProcessSuite]:
    suite = _suite(folder, 12)
    yield suite
    suite.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _live(position: int, num_new: int) -> int:
    """Blocks a request holds after a step at ``position`` of ``num_new`` tokens, from the rule itself:
    those with a token a query of this step or later can see (``j < k`` or ``j >= position - W + 1``)."""
    return len({j // BS for j in range(position + num_new) if j < SINKS or j >= position - WINDOW + 1})


def _drive(suite: InProcessSuite, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Runs one request to its end, step by step; asserts its live blocks after every step; returns its
    output and the most blocks it held."""
    sched, manager = suite.engine.scheduler, suite.manager
    spec = RequestSpec(request_id=request_id, prompt_token_ids=tuple(prompt),
                       sampling=SamplingParams(ignore_eos=True), max_tokens=max_tokens)
    req = Request(spec=spec, seq=0)
    sched.add(req)
    most = 0
    while not req.is_finished:
        position = req.num_computed_tokens
        step = sched.schedule()
        assert step is not None
        num_new = step.num_scheduled[request_id]
        sched.update(step, suite.runner_client.execute(step.step_input))
        stats = manager.stats()
        held = stats.num_blocks - stats.num_free_blocks
        assert held == _live(position, num_new), (position, num_new)
        most = max(most, held)
        manager.check_integrity()
    return list(req.output_token_ids), most


def test_a_stream_of_ten_pools_holds_exactly_its_live_blocks_and_matches_the_reference(
    small: InProcessSuite, hf: PreTrainedModel,
) -> None:
    manager = small.manager
    assert (manager.config.group_windows, manager.config.group_sink_tokens) == ((WINDOW,), (SINKS,))
    assert manager.config.max_model_len == 2**31 - 1
    assert manager.stats().num_blocks == 11
    prompt = _prompt(40, seed=0)
    out, most = _drive(small, "a", prompt, 520)  # 560 tokens through a pool of 48
    # The bound ceil(k / bs) + ceil((W - 1 + chunk) / bs) + 1 = 1 + 6 + 1 with prefill chunks of 8; the
    # chunks here start at multiples of 8, so the window never straddles the extra block.
    assert most == 7 <= 1 + 6 + 1
    assert out == streaming_generate(hf, prompt, 520, SINKS, WINDOW)
    # A second request after the first: the first's blocks are freed with its end.
    prompt_b = _prompt(70, seed=5)
    out_b, _ = _drive(small, "b", prompt_b, 90)
    assert out_b == streaming_generate(hf, prompt_b, 90, SINKS, WINDOW)
    small.engine.scheduler.kv.free(*small.engine.scheduler.take_pending_frees())
    assert manager.stats().num_free_blocks == 11


def test_a_prefix_hit_takes_the_sink_and_window_blocks(folder: Path, hf: PreTrainedModel) -> None:
    suite = _suite(folder, 64)  # room enough that nothing cached is evicted
    try:
        prompt = _prompt(60, seed=7)
        out_a, _ = _drive(suite, "a", prompt, 10)
        assert out_a == streaming_generate(hf, prompt, 10, SINKS, WINDOW)
        # The same prompt again: a hit of 14 blocks (56 tokens; the last token is always computed),
        # which needs the sink block 0 and the window's blocks 10..13 (tokens 41..55), not the middle.
        before = suite.manager.stats().prefix_cache_hits
        sched = suite.engine.scheduler
        spec = RequestSpec(request_id="b", prompt_token_ids=tuple(prompt), sampling=SamplingParams(ignore_eos=True),
                           max_tokens=30)
        req = Request(spec=spec, seq=0)
        sched.add(req)
        step = sched.schedule()
        assert step is not None
        (new,) = step.step_input.new_requests
        assert (new.num_computed_tokens, new.num_new_tokens) == (56, 4)
        assert suite.manager.stats().prefix_cache_hits - before == 56
        assert list(new.block_ids[1:10]) == [0] * 9 and 0 not in (new.block_ids[0], *new.block_ids[10:])
        sched.update(step, suite.runner_client.execute(step.step_input))
        while not req.is_finished:
            step = sched.schedule()
            assert step is not None
            sched.update(step, suite.runner_client.execute(step.step_input))
        assert list(req.output_token_ids) == streaming_generate(hf, prompt, 30, SINKS, WINDOW)
    finally:
        suite.close()


def test_the_engine_thread_streams_it_too(folder: Path, hf: PreTrainedModel) -> None:
    suite = _suite(folder, 12)
    suite.engine.start()
    try:
        prompt = _prompt(25, seed=9)
        spec = build_spec(suite.engine, prompt, SamplingParams(ignore_eos=True), 200, request_id="e")
        chunks = list(OutputStream(suite.engine, spec, None))
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == streaming_generate(hf, prompt, 200, SINKS, WINDOW)
    finally:
        suite.close()
    assert suite.manager.stats().num_free_blocks == 11


def test_admission_counts_the_sink_blocks() -> None:
    """A stream fits when its peak fits: ceil(k / bs) + ceil((W - 1 + chunk + bs - 1) / bs) blocks."""
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, async_scheduling=False)
    info = RunnerInfo(model_id="m", vocab_size=320, max_model_len=2**31 - 1, eos_token_ids=(), num_blocks=8,
                      block_size=BS, kv_group_windows=(WINDOW,), kv_group_sink_tokens=(SINKS,))
    with pytest.raises(InvalidArgument, match="needs 8 KV blocks but the whole pool has 7"):
        validate_request([5] * 40, SamplingParams(), 100_000, info, config)
    validate_request([5] * 40, SamplingParams(), 100_000, dataclasses.replace(info, num_blocks=9), config)
    # Without the sink the same window needs one block less.
    validate_request([5] * 40, SamplingParams(), 100_000, dataclasses.replace(info, kv_group_sink_tokens=()), config)
