"""The servicer's queue: a step sent ahead is queued on the compute thread behind the step it
follows while that one still runs, so the compute thread goes from one to the next without a
handler thread in between; block copies queue behind steps the same way.

The core is a real runner over the tiny Llama; only its ``execute`` is wrapped, to hold one step
at its start (a gate) and to record which step ran on which thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.runner import ModelRunner
from services.model_runner.servicer import ModelRunnerServicer
from services.model_runner.types import StepInput, StepOutput
from shared.errors import FailedPrecondition
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import model_runner_pb2 as pb
from shared.tensor_handle import SharedTensorHandle, handle_to_proto

BLOCK = 4
PROMPT = list(range(30, 40))  # 10 tokens in blocks 1-3: positions 10 and 11 fit


class _Context:
    """What the servicer asks of a gRPC context: the call's time left (None: no deadline)."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def context(remaining: float | None = None) -> grpc.ServicerContext:
    return cast(grpc.ServicerContext, _Context(remaining))


class Gated:
    """Wraps a core's ``execute``: holds step ``hold`` at its start until released, and records
    each step's id and the thread it ran on."""

    def __init__(self, core: ModelRunner, hold: int) -> None:
        self.execute: Callable[[StepInput], StepOutput] = core.execute
        self.hold, self.started, self.release = hold, threading.Event(), threading.Event()
        self.ran: list[tuple[int, int]] = []
        core.execute = self  # type: ignore[method-assign]

    def __call__(self, step: StepInput) -> StepOutput:
        if step.step_id == self.hold:
            self.started.set()
            assert self.release.wait(30)
        out = self.execute(step)
        self.ran.append((step.step_id, threading.get_native_id()))
        return out


@pytest.fixture
def core(tiny_llama_dir: Path) -> Iterator[ModelRunner]:
    runner = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), block_size=BLOCK, dtype="float32",
                                       attention_backend="torch", kv_cache_memory_bytes=32 * 2048, warmup=False))
    yield runner
    runner.pool.close()


def _new(step_id: int) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(step_id=step_id, new_requests=[pb.NewRequestData(
        request_id="d", token_ids=PROMPT, num_prompt_tokens=len(PROMPT), block_ids=[1, 2, 3],
        num_computed_tokens=0, num_new_tokens=len(PROMPT), sampling=common_pb2.SamplingParams())])


def _decode(step_id: int, computed: int, after: int = 0) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(step_id=step_id, after_step_id=after, cached_requests=[pb.CachedRequestData(
        request_id="d", num_computed_tokens=computed, num_new_tokens=1)])


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_step_sent_ahead_is_queued_while_the_one_it_follows_runs(core: ModelRunner,
                                                                   tiny_llama_dir: Path) -> None:
    servicer = ModelRunnerServicer(core)
    gate = Gated(core, hold=21)
    tokens = [servicer.Execute(_new(20), context()).sampled[0].token_id]
    with ThreadPoolExecutor(2) as calls:
        first = calls.submit(servicer.Execute, _decode(21, 10), context())
        assert gate.started.wait(30)  # step 21 runs (held at its start) on the compute thread
        ahead = calls.submit(servicer.Execute, _decode(22, 11, after=21), context(30.0))
        _until(lambda: servicer._order.last_queued == 22)  # queued behind 21 while 21 still runs
        assert not first.done() and not ahead.done()
        gate.release.set()
        tokens += [first.result(30).sampled[0].token_id, ahead.result(30).sampled[0].token_id]
    assert core.compute is not None
    compute_tid = core.compute.run(threading.get_native_id)
    assert gate.ran == [(20, compute_tid), (21, compute_tid), (22, compute_tid)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False, pad_token_id=0)[0, 10:].tolist()
    assert tokens == ref


def test_a_step_queued_behind_a_failed_one_is_refused_and_changes_nothing(core: ModelRunner) -> None:
    servicer = ModelRunnerServicer(core)
    gate = Gated(core, hold=21)
    servicer.Execute(_new(20), context())
    with ThreadPoolExecutor(2) as calls:
        bad = calls.submit(servicer.Execute, _decode(21, 99), context())  # a computed count the runner lacks
        assert gate.started.wait(30)
        ahead = calls.submit(servicer.Execute, _decode(22, 11, after=21), context(30.0))
        _until(lambda: servicer._order.last_queued == 22)
        gate.release.set()
        with pytest.raises(Exception) as refused:
            bad.result(30)
        assert "num_computed_tokens 99" in str(refused.value)
        with pytest.raises(FailedPrecondition, match="step 21, which this step follows, failed"):
            ahead.result(30)
    assert [step for step, _ in gate.ran] == [20]  # neither 21 nor 22 ran to completion
    # the runner's state is the one step 20 left: the decode of position 10 is still next
    assert servicer.Execute(_decode(23, 10), context()).sampled[0].request_id == "d"


def test_a_step_sent_ahead_whose_caller_gave_up_while_queued_does_not_run(core: ModelRunner) -> None:
    servicer = ModelRunnerServicer(core)
    gate = Gated(core, hold=21)
    servicer.Execute(_new(20), context())
    with ThreadPoolExecutor(2) as calls:
        first = calls.submit(servicer.Execute, _decode(21, 10), context())
        assert gate.started.wait(30)
        ahead = calls.submit(servicer.Execute, _decode(22, 11, after=21), context(0.05))
        _until(lambda: servicer._order.last_queued == 22)
        time.sleep(0.1)  # past step 22's deadline while it waits in the queue
        gate.release.set()
        first.result(30)
        with pytest.raises(FailedPrecondition, match="did not run in time"):
            ahead.result(30)
    assert [step for step, _ in gate.ran] == [20, 21]


def test_a_block_copy_waits_for_the_step_queued_before_it(core: ModelRunner) -> None:
    """CopyBlocksOut of a block the held step writes reads what that step wrote: the copy runs on
    the compute thread after it, never beside it."""
    servicer = ModelRunnerServicer(core)
    gate = Gated(core, hold=20)
    shape = (2, *core.pool.shape[:2], *core.pool.shape[3:])
    path = os.path.join(core.pool.shm_dir, f"kvmesh-test-staging-{uuid.uuid4().hex}")
    staging = torch.from_file(path, shared=True, size=math.prod(shape), dtype=torch.float32).view(shape)
    try:
        handle = handle_to_proto(SharedTensorHandle(kind="shm_file", dtype="float32", shape=shape,
                                                    nbytes=math.prod(shape) * 4, path=path))
        with ThreadPoolExecutor(2) as calls:
            prefill: Future[pb.ExecuteResponse] = calls.submit(servicer.Execute, _new(20), context())
            assert gate.started.wait(30)
            copy = calls.submit(servicer.CopyBlocksOut, pb.CopyBlocksRequest(
                block_ids=[1], staging=handle, staging_rows=[0]), context())
            time.sleep(0.1)
            assert not copy.done()  # queued behind the held step
            gate.release.set()
            prefill.result(30)
            assert copy.result(30).num_blocks == 1
        assert torch.count_nonzero(staging[0]) > 0  # the K/V step 20 wrote into block 1
        assert torch.equal(staging[0], core.pool.tensor[:, :, 1])
    finally:
        os.unlink(path)



def test_a_step_after_one_whose_predecessor_never_came_is_refused_as_failed(core: ModelRunner) -> None:
    """Step 22 names a step 21 that never arrives: refused at its deadline. Step 23, sent ahead
    behind 22, is refused at its turn because 22 failed, not left waiting for its own deadline;
    the runner's state is still step 20's."""
    servicer = ModelRunnerServicer(core)
    servicer.Execute(_new(20), context())
    with pytest.raises(FailedPrecondition, match="step 21, which this step follows, did not run in time"):
        servicer.Execute(_decode(22, 11, after=21), context(0.05))
    with pytest.raises(FailedPrecondition, match="step 22, which this step follows, failed"):
        servicer.Execute(_decode(23, 12, after=22), context(60.0))
    assert servicer.Execute(_decode(24, 10), context()).sampled[0].request_id == "d"
