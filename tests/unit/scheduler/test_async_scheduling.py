"""Async scheduling over the real in-process cores: which steps are sent ahead, and that nothing
about the answer changes (tokens, stops, the prefix cache the steps leave, every block freed).

Block size 16, a 30-token prompt, 20 new tokens. Step 1 reads the prompt and, with async
scheduling, reserves 16 slots past it (lookahead): 3 blocks, 48 slots. Step j >= 2 computes
position 28 + j, so steps 2-19 fit the slots held and are sent ahead; step 20 needs a fourth
block (synchronous): 20 steps, 18 of them sent ahead. Without the reserve step 4 would have been
synchronous as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.model_runner.config import RunnerConfig
from services.model_runner.types import StepInput
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.lookahead import plan_ahead
from services.scheduler.queues import RequestQueues
from services.scheduler.request import FinishReason, Request, RequestSpec, RequestStatus
from services.scheduler.step import ScheduledStep
from services.scheduler.stream import OutputStream, build_spec
from services.scheduler.types import Chunk
from shared.sampling_params import SamplingParams

BLOCK = 16
PROMPT = list(range(100, 130))  # 30 tokens
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return list(out[0, len(PROMPT):].tolist())


def _suite(model_dir: Path, async_scheduling: bool) -> InProcessSuite:
    rc = RunnerConfig(model_dir=str(model_dir), block_size=BLOCK, kv_cache_memory_bytes=64 * 8192, warmup=False,
                      dtype="float32", attention_backend="torch")
    return build_inprocess(rc, SchedulerConfig(async_scheduling=async_scheduling))


def _run(suite: InProcessSuite, prompt: list[int], params: SamplingParams, rid: str) -> list[Chunk]:
    spec = build_spec(suite.engine, prompt, params, MAX_TOKENS, request_id=rid)
    return list(OutputStream(suite.engine, spec, suite.tokenizer))


def _tokens(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _wait_idle(suite: InProcessSuite) -> None:
    import time

    deadline = time.monotonic() + 10
    while suite.manager.stats().num_requests and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(("async_scheduling", "ahead"), [(True, 18), (False, 0)])
def test_steps_sent_ahead_and_the_answer_and_cache_they_leave(tiny_llama_dir: Path, reference: list[int],
                                                              async_scheduling: bool, ahead: int) -> None:
    suite = _suite(tiny_llama_dir, async_scheduling)
    try:
        chunks = _run(suite, PROMPT, SamplingParams(ignore_eos=True), "a")
        assert _tokens(chunks) == reference
        assert (suite.engine.num_steps, suite.engine.num_steps_ahead) == (MAX_TOKENS, ahead)
        _wait_idle(suite)
        stats = suite.manager.stats()
        # 49 tokens computed: 3 full blocks registered (though the manager heard of most late).
        assert (stats.num_requests, stats.num_free_blocks, stats.num_cached_blocks) == (0, stats.num_blocks, 3)
        suite.manager.check_integrity()
        # The kv-cache-manager heard of the steps sent ahead late, yet registered every full block
        # they computed: 50 known tokens, (50 - 1) // 16 = 3 blocks hit.
        follow = _run(suite, PROMPT + reference, SamplingParams(ignore_eos=True), "b")
        final = follow[-1].final
        assert final is not None and final.metrics is not None and final.metrics.cached_tokens == 48
    finally:
        suite.close()


def test_a_synchronous_step_is_sent_before_the_tokens_of_the_step_before_it_stream(
        tiny_llama_dir: Path, reference: list[int]) -> None:
    """With nothing in flight after a step, the engine plans and sends the next step before it
    pushes the step's tokens to the streams (whose handler threads would otherwise hold the GIL
    while the runner waits). Async scheduling off, so every step is synchronous: each step's
    submit comes before the tokens of the step before it; the last step's tokens, with nothing
    left to send, after it. The answer is unchanged."""
    suite = _suite(tiny_llama_dir, async_scheduling=False)
    order: list[str] = []
    engine = suite.engine
    submit, push = engine.runner.submit, engine.outputs.push

    def recorded_submit(step: StepInput) -> object:
        order.append(f"step {step.step_id}")
        return submit(step)

    def recorded_push(events: list[object]) -> None:
        order.append(f"tokens {len(events)}")
        push(events)  # type: ignore[arg-type]

    engine.runner.submit = recorded_submit  # type: ignore[method-assign,assignment]
    engine.outputs.push = recorded_push  # type: ignore[method-assign,assignment]
    try:
        chunks = _run(suite, PROMPT, SamplingParams(ignore_eos=True), "a")
        assert _tokens(chunks) == reference
        steps = [o for o in order if o.startswith("step")]
        assert len(steps) == MAX_TOKENS
        expected = [steps[0]]
        for later in steps[1:]:
            expected += [later, "tokens 1"]
        assert order == [*expected, "tokens 1"]
    finally:
        suite.close()


def test_the_tokens_computed_go_out_before_a_failed_synchronous_planning_ends_the_request(
        tiny_llama_dir: Path, reference: list[int]) -> None:
    """The kv-cache-manager fails the third step's planning: the second step's token still reaches
    the stream before the error that ends it (the push runs before the failure is handled), and
    every block is freed after."""
    from shared.errors import KVMeshError

    suite = _suite(tiny_llama_dir, async_scheduling=False)
    kv = suite.engine.scheduler.kv
    kv_step, calls = kv.step, [0]

    def failing_step(*args: object) -> object:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("kv-cache-manager fault (test)")
        return kv_step(*args)  # type: ignore[arg-type]

    kv.step = failing_step  # type: ignore[method-assign,assignment]
    try:
        spec = build_spec(suite.engine, PROMPT, SamplingParams(ignore_eos=True), MAX_TOKENS, request_id="f")
        received: list[Chunk] = []
        with pytest.raises(KVMeshError):
            for chunk in OutputStream(suite.engine, spec, suite.tokenizer):
                received.append(chunk)
        assert _tokens(received) == reference[:2]
        kv.step = kv_step  # type: ignore[method-assign]
        _wait_idle(suite)
        assert suite.manager.stats().num_requests == 0
        suite.manager.check_integrity()
    finally:
        suite.close()


def test_a_stop_token_inside_a_chain_of_steps_sent_ahead_changes_nothing(tiny_llama_dir: Path,
                                                                         reference: list[int]) -> None:
    """The step after a stop token was sent before the stop was known: its token is dropped, and
    the stream, the stop reason and the freed blocks are exactly those of synchronous steps."""
    stop_at = next(i for i in range(6, MAX_TOKENS) if reference[i] not in reference[:i])
    params = SamplingParams(ignore_eos=True, stop_token_ids=(reference[stop_at],))
    runs = []
    for async_scheduling in (True, False):
        suite = _suite(tiny_llama_dir, async_scheduling)
        try:
            chunks = _run(suite, PROMPT, params, "s")
            runs.append([(c.token_ids, c.final.finish_reason if c.final else None,
                          c.final.stop_reason if c.final else None) for c in chunks])
            assert _tokens(chunks) == reference[: stop_at + 1]
            assert chunks[-1].final is not None and chunks[-1].final.finish_reason is FinishReason.STOP
            # Steps 2 to stop_at + 2 were sent ahead (step stop_at + 1 sampled the stop token), the
            # last of them before the stop was known: it computed a token nobody reads.
            assert stop_at + 2 < MAX_TOKENS - 1
            assert suite.engine.num_steps_ahead == ((stop_at + 1) if async_scheduling else 0)
            _wait_idle(suite)  # the blocks are freed once the step after the stop returned
            assert suite.engine.num_steps == stop_at + 1 + async_scheduling
            stats = suite.manager.stats()
            assert (stats.num_requests, stats.num_free_blocks) == (0, stats.num_blocks)
            suite.manager.check_integrity()
        finally:
            suite.close()
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ plan_ahead, step by step
def _running(rid: str, prompt: int, outputs: int, computed: int, blocks: int, max_tokens: int = 100) -> Request:
    spec = RequestSpec(request_id=rid, prompt_token_ids=tuple(range(3, 3 + prompt)), max_tokens=max_tokens,
                       sampling=SamplingParams(ignore_eos=True))
    req = Request(spec=spec, seq=0, status=RequestStatus.RUNNING, output_token_ids=list(range(outputs)),
                  num_computed_tokens=computed, block_tables=[list(range(1, blocks + 1))])
    return req


def _queues(*reqs: Request) -> RequestQueues:
    q = RequestQueues()
    for r in reqs:
        q.requests[r.request_id] = r
        q.running.append(r)
    return q


def _prev(**num_scheduled: int) -> ScheduledStep:
    return ScheduledStep(StepInput(step_id=7), dict(num_scheduled))


def test_plan_ahead_continues_decodes_and_prefill_chunks_on_the_slots_held() -> None:
    dec = _running("dec", prompt=10, outputs=2, computed=11, blocks=1)  # step 7 computes 11 -> samples
    chunk = _running("pre", prompt=40, outputs=0, computed=0, blocks=3)  # step 7 reads 16 of 40
    q = _queues(dec, chunk)
    step = plan_ahead(_prev(dec=1, pre=16), q, step_id=8, block_size=16, max_model_len=1000, max_num_seqs=8,
                      token_budget=20)
    assert step is not None and not step.allocated
    assert step.step_input.after_step_id == 7 and step.step_input.step_id == 8
    assert [(c.request_id, c.num_computed_tokens, c.num_new_tokens, c.new_block_ids)
            for c in step.step_input.cached_requests] == [("dec", 12, 1, ()), ("pre", 16, 19, ())]
    assert (dec.num_unreported_tokens, chunk.num_unreported_tokens) == (1, 19)


@pytest.mark.parametrize("why", ["needs a block", "pending free", "admission", "not in the step"])
def test_plan_ahead_leaves_to_a_synchronous_step(why: str) -> None:
    dec = _running("dec", prompt=10, outputs=6, computed=15, blocks=1)  # position 16 needs block 2
    q = _queues(dec)
    prev = _prev(dec=1)
    if why != "needs a block":
        dec.block_tables = [[1, 2]]
    if why == "pending free":
        q.pending_frees.append("gone")
    if why == "admission":
        waiting = _running("w", prompt=4, outputs=0, computed=0, blocks=0)
        waiting.status = RequestStatus.WAITING
        q.waiting.append(waiting)
    if why == "not in the step":
        prev = _prev(other=1)
    assert plan_ahead(prev, q, 8, 16, 1000, 8, 512) is None
    assert dec.num_unreported_tokens == 0


def test_plan_ahead_leaves_out_a_request_its_step_ends_by_length() -> None:
    last = _running("last", prompt=10, outputs=4, computed=13, blocks=2, max_tokens=5)  # step 7 samples token 5
    other = _running("other", prompt=10, outputs=4, computed=13, blocks=2)
    step = plan_ahead(_prev(last=1, other=1), _queues(last, other), 8, 16, 1000, 8, 512)
    assert step is not None and list(step.num_scheduled) == ["other"]
    assert plan_ahead(_prev(last=1), _queues(last), 8, 16, 1000, 8, 512) is None


def test_seeded_sampling_and_logprobs_are_those_of_synchronous_steps(tiny_llama_dir: Path) -> None:
    """Two requests sampling with seeds (and one asking for logprobs) side by side: the chunks,
    tokens and logprobs alike, are the same with async scheduling on and off."""
    params = [SamplingParams(temperature=0.9, top_k=20, seed=7, logprobs=2),
              SamplingParams(temperature=1.2, top_p=0.8, seed=11)]
    runs = []
    for async_scheduling in (True, False):
        suite = _suite(tiny_llama_dir, async_scheduling)
        try:
            streams = [OutputStream(suite.engine, build_spec(suite.engine, PROMPT[i:] + PROMPT[:i], p, MAX_TOKENS,
                                                             request_id=f"s{i}"), suite.tokenizer)
                       for i, p in enumerate(params)]
            runs.append([[(c.token_ids, c.logprobs) for c in s] for s in streams])
            assert suite.engine.num_steps_ahead > 0 if async_scheduling else suite.engine.num_steps_ahead == 0
        finally:
            suite.close()
    assert runs[0] == runs[1]
    assert all(sum(len(t) for t, _ in chunks) == MAX_TOKENS for chunks in runs[0])
    assert all(lp is not None for _, lps in runs[0][0] for lp in lps)
