"""Sliding-window models end to end over the real in-process cores: greedy output token-identical to
transformers' ``generate()`` at lengths well past the window, with chunked prefill, preemption and
prefix hits, and every block back in the pool afterwards.

Three tiny random checkpoints, window 16, blocks of 4 tokens, prompts of 100-180 tokens:

* ``mistral``: every layer slides (one window group);
* ``qwen2_max_window``: Qwen2 with ``use_sliding_window`` and ``max_window_layers=2`` of 4 layers
  (layers 0-1 full, 2-3 window: a full group and a window group);
* ``alternating``: Qwen2 with ``layer_types`` alternating window and full layers (Gemma-style).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model_runner.config import RunnerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.request import FinishReason
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.types import Chunk
from shared.sampling_params import SamplingParams

WINDOW = 16
MAX_TOKENS = 12
TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 320, "max_position_embeddings": 512, "initializer_range": 0.2, "bos_token_id": 1,
    "eos_token_id": None, "pad_token_id": 0, "sliding_window": WINDOW,
}
MODELS: dict[str, tuple[str, dict[str, Any], tuple[int | None, ...], int, int]] = {
    # name: (model_type, overrides, the runner's group windows, blocks in the pool, step token budget)
    # NOTE: Mistral holds only its window, so it needs long chunks (each holds its window plus the
    # chunk) to run out of blocks; the pool still covers a whole table (the runner's bound).
    "mistral": ("mistral", {"num_hidden_layers": 2, "head_dim": 16}, (WINDOW,), 50, 128),
    "qwen2_max_window": ("qwen2", {"num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 2},
                         (None, WINDOW), 110, 32),
    "alternating": ("qwen2", {"num_hidden_layers": 4, "use_sliding_window": True,
                              "layer_types": ["sliding_attention", "full_attention"] * 2}, (None, WINDOW), 110, 32),
}
# K/V of one block in one group: 2 layers per group x 2 (K, V) x 4 tokens x 2 heads x 16 dims x 4 bytes.
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(16)
    shared = torch.randint(3, 300, (60,), generator=g).tolist()
    return [shared + torch.randint(3, 300, (40 + 16 * i,), generator=g).tolist() for i in range(6)]


def _checkpoint(name: str, folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Saves ``name``'s tiny random checkpoint into ``folder``; returns transformers' greedy
    continuation of every prompt."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, _, _, _ = MODELS[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **overrides}),
                                          dtype=torch.float32).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[list[int]]]:
    """A checkpoint and transformers' greedy continuation of every prompt."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, _checkpoint(request.param, folder, _prompts())


def _suite(name: str, folder: Path, num_blocks: int | None = None, budget: int | None = None,
           async_scheduling: bool = False) -> InProcessSuite:
    num_blocks = num_blocks or MODELS[name][3]
    budget = budget or MODELS[name][4]
    rc = RunnerConfig(model_dir=str(folder), block_size=4, kv_cache_memory_bytes=num_blocks * BYTES_PER_BLOCK,
                      warmup=False, dtype="float32", attention_backend="torch")
    # Every prompt is read in chunks, each chunk's queries straddle the window.
    # Synchronous unless asked: the exact preemption and block counts below are the planner's
    # without async scheduling's slot reserve (which admits fewer at once on so small a pool).
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, async_scheduling=async_scheduling)
    return build_inprocess(rc, sc, with_tokenizer=False)


def _generate(suite: InProcessSuite, prompts: list[list[int]], tag: str) -> list[list[int]]:
    streams = [OutputStream(suite.engine, build_spec(suite.engine, p, SamplingParams(ignore_eos=True), MAX_TOKENS,
                                                     request_id=f"{tag}{i}"), None)
               for i, p in enumerate(prompts)]
    results: dict[str, list[Chunk] | Exception] = {}

    def collect(stream: OutputStream) -> None:
        try:
            results[stream.request_id] = list(stream)
        except Exception as exc:  # the stream's error, for the assertion below
            results[stream.request_id] = exc

    threads = [threading.Thread(target=collect, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    out = []
    for i in range(len(prompts)):
        chunks = results[f"{tag}{i}"]
        assert not isinstance(chunks, Exception), f"request {tag}{i} failed: {chunks}"
        final = chunks[-1].final
        assert final is not None and final.finish_reason is FinishReason.LENGTH
        out.append([t for c in chunks for t in c.token_ids])
    return out


def _wait_idle(suite: InProcessSuite) -> None:
    deadline = time.monotonic() + 10
    while suite.manager.stats().num_requests and time.monotonic() < deadline:
        time.sleep(0.01)


def _assert_all_free(suite: InProcessSuite) -> None:
    _wait_idle(suite)
    stats = suite.manager.stats()
    assert (stats.num_requests, stats.num_free_blocks) == (0, stats.num_blocks)
    suite.manager.check_integrity()


def test_greedy_matches_transformers_past_the_window(model: tuple[str, Path, list[list[int]]]) -> None:
    name, folder, refs = model
    suite = _suite(name, folder)
    try:
        info = suite.engine.info
        assert (info.kv_group_windows, info.num_blocks) == (MODELS[name][2], MODELS[name][3])
        assert info.max_model_len == 512  # the checkpoint's, not the window
        prompts = _prompts()
        # Wave 1: six requests at once on a pool that holds about two: chunked prefill, preemption.
        assert _generate(suite, prompts, "a") == refs
        assert suite.engine.scheduler.num_preemptions > 0
        assert suite.engine.num_steps_ahead == 0
        _wait_idle(suite)
        suite.manager.check_integrity()
        # Wave 2, one at a time: each prompt hits what wave 1 left cached (the shared head at
        # least, the whole prompt but its last block where nothing evicted it).
        before = suite.manager.stats().prefix_cache_hits
        for i, p in enumerate(prompts):
            assert _generate(suite, [p], f"b{i}-") == [refs[i]], f"prompt {i} after a prefix hit"
        assert suite.manager.stats().prefix_cache_hits > before
        _assert_all_free(suite)
    finally:
        suite.close()


def test_async_scheduling_matches_transformers_past_the_window(model: tuple[str, Path, list[list[int]]]) -> None:
    """The same six requests with async scheduling (steps sent ahead, the lookahead slot reserve,
    the kv-cache-manager hearing of tokens late and freeing slid-out blocks late): the same tokens,
    and every block free after."""
    name, folder, refs = model
    suite = _suite(name, folder, async_scheduling=True)
    try:
        assert _generate(suite, _prompts(), "x") == refs
        assert suite.engine.num_steps_ahead > 0
        _assert_all_free(suite)
    finally:
        suite.close()


def test_a_window_model_serves_a_request_longer_than_the_pool(tmp_path: Path) -> None:
    prompt = _prompts()[2]  # 132 tokens + 12: 36 positions in a pool of 19 usable blocks
    refs = _checkpoint("mistral", tmp_path, [prompt])
    # Chunks of 32: a window of 16 plus a chunk is at most 13 blocks at any step.
    suite = _suite("mistral", tmp_path, num_blocks=20, budget=32)
    try:
        assert _generate(suite, [prompt], "long") == refs
    finally:
        suite.close()
