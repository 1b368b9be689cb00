"""The engine over the real in-process cores: greedy output token-identical to transformers.

Many concurrent requests on a pool too small to hold them all force preemption; outputs must
not change, with prefix caching on or off, and afterwards every block is free again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.model_runner.config import RunnerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.request import FinishReason
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.types import Chunk
from shared.sampling_params import SamplingParams

MAX_TOKENS = 10


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, 370, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(3, 370, (5 + 7 * i % 30,), generator=g).tolist()
        out.append(shared + own if i % 2 == 0 else own + shared[:9])
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[int, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other
    ref = {}
    for i, p in enumerate(_prompts(8)):
        out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        ref[i] = out[0, len(p):].tolist()
    return ref


def _suite(model_dir: Path, prefix: bool, blocks_bytes: int) -> InProcessSuite:
    # dtype and backend pinned: the exact reference mode (the defaults are per machine).
    rc = RunnerConfig(model_dir=str(model_dir), block_size=4, kv_cache_memory_bytes=blocks_bytes, warmup=False,
                      dtype="float32", attention_backend="torch")
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=prefix)
    return build_inprocess(rc, sc)


def _collect(stream: OutputStream, out: dict[str, list[Chunk]]) -> None:
    out[stream.request_id] = list(stream)


@pytest.mark.parametrize("prefix", [True, False])
def test_concurrent_greedy_matches_transformers(tiny_llama_dir: Path, reference: dict[int, list[int]],
                                                prefix: bool) -> None:
    # bytes per block: 2 layers * 2 * 4 tokens * 2 kv heads * 16 dim * 4 B = 2048 -> 40 blocks (39 usable):
    # 8 requests of ~60-90 tokens need ~150 blocks at once, so the engine must preempt.
    suite = _suite(tiny_llama_dir, prefix, 40 * 2048)
    try:
        engine = suite.engine
        streams = []
        for i, p in enumerate(_prompts(8)):
            spec = build_spec(engine, p, SamplingParams(ignore_eos=True), MAX_TOKENS, request_id=f"r{i}")
            streams.append(OutputStream(engine, spec, suite.tokenizer))
        results: dict[str, list[Chunk]] = {}
        threads = [threading.Thread(target=_collect, args=(s, results)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(8):
            chunks = results[f"r{i}"]
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == reference[i], f"request {i}"
            final = chunks[-1].final
            assert final is not None and final.finish_reason is FinishReason.LENGTH
            assert final.metrics is not None and final.metrics.completion_tokens == MAX_TOKENS
        assert engine.scheduler.num_preemptions > 0
        _wait_idle(suite)
        stats = suite.manager.stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_requests == 0
        suite.manager.check_integrity()
        if prefix:
            assert stats.prefix_cache_hits > 0
    finally:
        suite.close()


def _wait_idle(suite: InProcessSuite, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if suite.manager.stats().num_requests == 0:
            return
        time.sleep(0.01)


def test_cancel_frees_blocks(tiny_llama_dir: Path) -> None:
    suite = _suite(tiny_llama_dir, True, 64 * 2048)
    try:
        spec = build_spec(suite.engine, _prompts(1)[0], SamplingParams(ignore_eos=True), 200, request_id="c")
        stream = OutputStream(suite.engine, spec, suite.tokenizer)
        it: Iterator[Chunk] = iter(stream)
        next(it)
        assert suite.manager.stats().num_requests == 1
        stream.cancel()
        rest = list(it)
        assert rest[-1].final is not None and rest[-1].final.finish_reason is FinishReason.ABORT
        _wait_idle(suite)
        assert suite.manager.stats().num_requests == 0
        suite.manager.check_integrity()
    finally:
        suite.close()


def test_deadline_ends_the_stream_with_deadline_exceeded_and_frees_blocks(tiny_llama_dir: Path) -> None:
    """The engine's own expiry (not only the client's timer) ends the stream with the
    DEADLINE_EXCEEDED error, never with an ordinary final chunk."""
    import time

    from shared.errors import DeadlineExceeded

    suite = _suite(tiny_llama_dir, True, 64 * 2048)
    try:
        spec = build_spec(suite.engine, _prompts(1)[0], SamplingParams(ignore_eos=True), 200, request_id="d",
                          deadline=time.monotonic() + 0.05)  # fmt: skip
        received: list[Chunk] = []
        with pytest.raises(DeadlineExceeded):
            for chunk in OutputStream(suite.engine, spec, suite.tokenizer):
                received.append(chunk)
        assert all(c.final is None for c in received)
        _wait_idle(suite)
        assert suite.manager.stats().num_requests == 0
        suite.manager.check_integrity()
    finally:
        suite.close()
