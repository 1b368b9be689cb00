"""A forced prefix-hash collision (shared.hashing.force_collisions) over the real in-process cores:
the kv-cache-manager's token check turns it into a miss, and the answer equals transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.model_runner.config import RunnerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import build_inprocess
from services.scheduler.stream import OutputStream, build_spec
from shared import hashing
from shared.sampling_params import SamplingParams

BLOCK = 4
MAX_TOKENS = 6


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


X = _tokens(21, 41)
Y = X[:8] + _tokens(22, 33)  # the same first two blocks, then other tokens: same length, same hashes


@pytest.fixture
def collisions() -> Iterator[None]:
    hashing.force_collisions(True)
    try:
        yield
    finally:
        hashing.force_collisions(False)


def test_forced_collision_is_a_miss_not_wrong_kv(tiny_llama_dir: Path, collisions: None) -> None:
    from transformers import AutoModelForCausalLM

    seed = b"\x00" * 32
    assert hashing.hash_blocks(seed, X, BLOCK) == hashing.hash_blocks(seed, Y, BLOCK)  # the hook works
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    expected_y = model.generate(torch.tensor([Y]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(Y):].tolist()
    suite = build_inprocess(RunnerConfig(model_dir=str(tiny_llama_dir), block_size=BLOCK, warmup=False,
                                         kv_cache_memory_bytes=64 * 2048), SchedulerConfig(), with_tokenizer=False)

    def run(prompt: list[int]) -> tuple[list[int], int]:
        spec = build_spec(suite.engine, prompt, SamplingParams(ignore_eos=True), MAX_TOKENS)
        chunks = list(OutputStream(suite.engine, spec, None))
        final = chunks[-1].final
        assert final is not None and final.metrics is not None
        return [t for c in chunks for t in c.token_ids], final.metrics.cached_tokens

    try:
        _, cached_x = run(X)
        ids_y, cached_y = run(Y)
        _, cached_x2 = run(X)
        assert cached_x == 0
        assert cached_y == 8  # the two blocks Y really shares with X; block 2's collision is a miss
        assert ids_y == expected_y
        assert cached_x2 == 40
        suite.manager.check_integrity()
    finally:
        suite.close()
