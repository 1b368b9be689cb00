"""Amplification limits on the public API (issue 12, item 6), over a real gRPC server around the
in-process engine: oversized strings are refused with ``INVALID_ARGUMENT`` naming the field before
the tokenizer runs, the tokenizer's concurrency is bounded, and a bystander's answer is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.model_runner.config import RunnerConfig
from services.scheduler.client import KVMeshClient
from services.scheduler.config import SchedulerConfig
from services.scheduler.inprocess import InProcessSuite, build_inprocess
from services.scheduler.servicer import SchedulerServicer
from shared.config import ServerConfig
from shared.grpc_server import RunningServer, ServiceRegistration, start_server
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

BYSTANDER = list(range(5, 45))
FOUR_MB = 4_000_000


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[InProcessSuite, SchedulerServicer, RunningServer]]:
    rc = RunnerConfig(model_dir=str(tiny_llama_dir), block_size=4, kv_cache_memory_bytes=64 * 2048, warmup=False)
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_concurrent_tokenizations=1,
                         tokenize_wait_seconds=0.0)
    suite = build_inprocess(rc, sc)
    servicer = SchedulerServicer(suite.engine, suite.tokenizer)
    running = start_server(ServerConfig(port=0, max_receive_message_bytes=8 << 20), [ServiceRegistration(
        "kvmesh.v1.Scheduler", servicer, scheduler_pb2_grpc.add_SchedulerServicer_to_server)])
    yield suite, servicer, running
    running.stop(0)
    suite.close()


def _client(running: RunningServer) -> KVMeshClient:
    return KVMeshClient(f"127.0.0.1:{running.port}")


def _refused(running: RunningServer, prompt: object, **kwargs: object) -> grpc.RpcError:
    with _client(running) as client, pytest.raises(grpc.RpcError) as info:
        client.complete(prompt, 4, **kwargs)
    return info.value


def test_limits_follow_max_model_len(served: tuple[InProcessSuite, SchedulerServicer, RunningServer]) -> None:
    suite, _, _ = served
    assert suite.engine.info.max_model_len == 512  # the tiny checkpoint: 512 x 32 = 16,384 bytes of text


def test_a_4mb_prompt_is_refused_before_the_tokenizer_runs(
        served: tuple[InProcessSuite, SchedulerServicer, RunningServer]) -> None:
    suite, servicer, running = served
    assert servicer.tokenizer is not None
    runs = servicer.tokenizer.runs
    err = _refused(running, "a" * FOUR_MB)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "text: longer than the limit of 16384 bytes")
    err = _refused(running, [("user", "é" * (FOUR_MB // 2))])
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "chat.messages.content: all messages together are longer than the limit of 16384 bytes")
    # Many messages that are small one by one are bounded together.
    err = _refused(running, [("user", "b" * 9000), ("assistant", "c" * 9000)])
    assert err.details() == "chat.messages.content: all messages together are longer than the limit of 16384 bytes"
    with _client(running) as client, pytest.raises(grpc.RpcError) as info:
        client.tokenize("a" * FOUR_MB)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "text: longer than the limit of 16384 bytes")
    assert servicer.tokenizer.runs == runs  # nothing was tokenized
    # Just under the limit is tokenized (and then judged in tokens, as before).
    with _client(running) as client:
        assert len(client.tokenize("a" * 16384)) > 0
    assert servicer.tokenizer.runs == runs + 1
    assert suite.manager.stats().num_requests == 0


@pytest.mark.parametrize("field,kwargs,message", [
    ("request_id", {"request_id": "r" * 1_000_000}, "request_id: longer than the limit of 256 bytes"),
    ("cache_salt", {"cache_salt": "s" * 257}, "cache_salt: longer than the limit of 256 bytes"),
    ("stop", {"stop": ["x" * 300]}, "stop: longer than the limit of 256 bytes"),
    ("stop", {"stop": [str(i) for i in range(17)]}, "stop: 17 strings exceed the limit of 16"),
])
def test_oversized_string_fields_are_refused_naming_the_field(
        served: tuple[InProcessSuite, SchedulerServicer, RunningServer], field: str, kwargs: dict[str, object],
        message: str) -> None:
    suite, servicer, running = served
    assert servicer.tokenizer is not None
    runs = servicer.tokenizer.runs
    for prompt in (BYSTANDER, "some text"):  # token ids and text: refused before tokenizing either way
        err = _refused(running, prompt, **kwargs)
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert servicer.tokenizer.runs == runs
    assert suite.manager.stats().num_requests == 0


Served = tuple[InProcessSuite, SchedulerServicer, RunningServer]


def test_detokenize_is_bounded_by_max_model_len(served: Served) -> None:
    _, _, running = served
    stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=[5] * 513))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "token_ids: 513 ids exceed max_model_len 512")


def test_tokenizer_concurrency_is_bounded(served: tuple[InProcessSuite, SchedulerServicer, RunningServer]) -> None:
    _, servicer, running = served
    with servicer.tokenize_gate.slot():  # the one slot is busy: a text request cannot start
        err = _refused(running, "hello world")
        assert (err.code(), err.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "tokenizer busy (1 tokenizations running); retry later")
    with _client(running) as client:
        _, ids, final = client.complete("hello world", 3, ignore_eos=True)
    assert len(ids) == 3 and final.completion_tokens == 3


def test_a_bystander_is_unaffected_by_hostile_requests(
        served: tuple[InProcessSuite, SchedulerServicer, RunningServer]) -> None:
    suite, _, running = served
    with _client(running) as client:
        _, cold, _ = client.complete(BYSTANDER, 24, ignore_eos=True, cache_salt="cold")
    codes: list[grpc.StatusCode] = []

    def hostile() -> None:
        for i in range(6):
            err = _refused(running, "a" * FOUR_MB if i % 2 else BYSTANDER, request_id="r" * 1_000_000)
            codes.append(err.code())

    t = threading.Thread(target=hostile)
    t.start()
    with _client(running) as client:
        _, ids, final = client.complete(BYSTANDER, 24, ignore_eos=True, cache_salt="bystander")
    t.join(60)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 6
    assert ids == cold and final.completion_tokens == 24
    stats = suite.manager.stats()
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
