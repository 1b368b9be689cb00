"""The whole suite as real processes on loopback, driven through the public gRPC API.

Greedy output must be token-identical to transformers' ``generate()`` while requests are
preempted, with prefix sharing and without it (unique salts); cancellation, deadlines and every
validation error must leave the suite serving with no leaked block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.pb.kvmesh.v1 import (
    common_pb2,
    kv_cache_manager_pb2,
    kv_cache_manager_pb2_grpc,
    scheduler_pb2,
)

# 24 new tokens: 6 blocks of growth per request, so the running ones outgrow the pool and preempt
# even with async scheduling's slot reserve (a block per request, which makes admission more
# cautious: with 8 tokens, one run in three had no preemption).
MAX_TOKENS = 24
N_REQUESTS = 10


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 370, (48,), generator=g).tolist()
    return [system + torch.randint(3, 370, (4 + 5 * i,), generator=g).tolist() for i in range(N_REQUESTS)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            [0, len(p):].tolist() for p in _prompts()]


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    # 2048 bytes per block of 4 tokens -> 48 blocks: 10 requests of ~55-100 tokens cannot all fit.
    env = {
        "KVMESH_RUNNER_BLOCK_SIZE": "4",
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(48 * 2048),
        "KVMESH_RUNNER_WARMUP": "0",
        # The exact reference mode (the defaults are per machine): compared with generate() below.
        "KVMESH_RUNNER_DTYPE": "float32",
        "KVMESH_RUNNER_ATTENTION_BACKEND": "torch",
        "KVMESH_SCHED_MAX_NUM_BATCHED_TOKENS": "96",
        "KVMESH_SCHED_MAX_WAITING_REQUESTS": "32",
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=False,
                          log_dir=str(tmp_path_factory.mktemp("suite-logs")), extra_env=env))
    yield s
    s.stop()


def _kvm(suite: Suite) -> kv_cache_manager_pb2_grpc.KVCacheManagerStub:
    return kv_cache_manager_pb2_grpc.KVCacheManagerStub(
        grpc.insecure_channel(suite.services["kv-cache-manager"].address))


def _wait_all_free(suite: Suite, timeout: float = 10.0) -> kv_cache_manager_pb2.KVCacheStats:
    kvm = _kvm(suite)
    deadline = time.monotonic() + timeout
    while True:
        stats = kvm.GetStats(kv_cache_manager_pb2.GetStatsRequest())
        if stats.num_requests == 0 or time.monotonic() > deadline:
            kvm.CheckIntegrity(kv_cache_manager_pb2.CheckIntegrityRequest())
            return stats
        time.sleep(0.02)


def _run_concurrently(suite: Suite, salts: list[str]) -> dict[int, tuple[list[int], scheduler_pb2.GenerateFinal]]:
    results: dict[int, tuple[list[int], scheduler_pb2.GenerateFinal]] = {}

    def one(i: int, prompt: list[int]) -> None:
        with KVMeshClient(suite.address) as client:
            _, ids, final = client.complete(prompt, MAX_TOKENS, ignore_eos=True, cache_salt=salts[i])
            results[i] = (ids, final)

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(_prompts())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


@pytest.mark.parametrize("sharing", ["shared-prefix", "unique-salts"])
def test_concurrent_streams_match_transformers(suite: Suite, reference: list[list[int]], sharing: str) -> None:
    salts = [""] * N_REQUESTS if sharing == "shared-prefix" else [f"tenant-{i}-{sharing}" for i in range(N_REQUESTS)]
    results = _run_concurrently(suite, salts)
    assert sorted(results) == list(range(N_REQUESTS))
    for i, (ids, final) in results.items():
        assert ids == reference[i], f"request {i}"
        assert final.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
        assert final.completion_tokens == MAX_TOKENS
        assert final.prompt_tokens == len(_prompts()[i])
    assert sum(final.preemptions for _, final in results.values()) > 0
    if sharing == "unique-salts":
        assert all(final.cached_tokens == 0 for _, final in results.values())
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks


def test_prefix_hit_reported_in_final_chunk(suite: Suite) -> None:
    prompt = _prompts()[0]
    with KVMeshClient(suite.address) as client:
        client.complete(prompt, 2, cache_salt="hit-test")
        _, _, final = client.complete(prompt, 2, cache_salt="hit-test")
    assert final.cached_tokens == (len(prompt) - 1) // 4 * 4
    _wait_all_free(suite)


def test_cancel_mid_stream_frees_blocks(suite: Suite) -> None:
    with KVMeshClient(suite.address) as client:
        stream = client.generate(_prompts()[1], 120, ignore_eos=True)
        first = next(stream)
        assert len(first.token_ids) >= 1
        stats = _kvm(suite).GetStats(kv_cache_manager_pb2.GetStatsRequest())
        assert stats.num_requests == 1
        stream.close()  # cancels the call
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks


def test_deadline_aborts_and_frees(suite: Suite) -> None:
    prompt = _prompts()[2]
    received = []
    # NOTE: 125 tokens (what the pool allows next to this prompt) take the suite well over 0.15 s:
    # each step is three RPCs. Whether the server's expiry or the client's timer fires first, the
    # status is DEADLINE_EXCEEDED and no final chunk was sent.
    with KVMeshClient(suite.address) as client, pytest.raises(grpc.RpcError) as info:
        for chunk in client.generate(prompt, 125, ignore_eos=True, timeout=0.15):
            received.append(chunk)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not any(c.HasField("final") for c in received)
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks


def _bad_requests() -> list[tuple[str, scheduler_pb2.GenerateRequest, str]]:
    ok = list(range(3, 10))
    req = KVMeshClient.request
    cases = [
        ("empty prompt", req([], 4), "prompt"),
        ("no prompt", scheduler_pb2.GenerateRequest(max_tokens=4), "prompt"),
        ("prompt too long", req([5] * 600, 4), "prompt"),
        ("prompt + max_tokens too long", req(ok, 510), "max_tokens"),
        ("max_tokens zero", req(ok, 0), "max_tokens"),
        ("max_tokens negative", req(ok, -3), "max_tokens"),
        ("token id negative", req([3, -1], 4), "prompt"),
        ("token id past vocab", req([3, 384], 4), "prompt"),
        ("stop id past vocab", req(ok, 4, stop_token_ids=[9999]), "stop_token_ids"),
        ("temperature negative", req(ok, 4, temperature=-0.5), "temperature"),
        ("temperature NaN", req(ok, 4, temperature=float("nan")), "temperature"),
        ("top_p zero", req(ok, 4, top_p=0.0), "top_p"),
        ("top_p above one", req(ok, 4, top_p=1.5), "top_p"),
        ("too many logprobs", req(ok, 4, logprobs=1000), "logprobs"),
        ("needs more blocks than the pool", req([5] * 100, 300), "blocks"),
    ]
    nan_penalty = req(ok, 4)
    nan_penalty.sampling.CopyFrom(common_pb2.SamplingParams(presence_penalty=float("nan")))
    cases.append(("presence_penalty NaN", nan_penalty, "presence_penalty"))
    return cases


@pytest.mark.parametrize(("name", "request_msg", "field"), _bad_requests(), ids=[c[0] for c in _bad_requests()])
def test_validation_errors(suite: Suite, name: str, request_msg: scheduler_pb2.GenerateRequest, field: str) -> None:
    with KVMeshClient(suite.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.stub.Generate(request_msg))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert field in (info.value.details() or "")
        # ... and the suite keeps serving.
        _, ids, final = client.complete(list(range(3, 10)), 2)
        assert len(ids) >= 1 and final is not None
    _wait_all_free(suite)


def test_admission_control_rejects_when_queue_full(suite: Suite) -> None:
    """More than max_waiting_requests (32) at once: the excess gets RESOURCE_EXHAUSTED at once."""
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    # all 48 connected before any sends: on a loaded machine, connecting one by one could let the
    # server finish requests as fast as they arrive, and the queue would never overflow
    ready = threading.Barrier(48)

    def one() -> None:
        with KVMeshClient(suite.address) as client:
            grpc.channel_ready_future(client.channel).result(timeout=60)
            ready.wait(60)
            try:
                client.complete([5] * 60, 40, ignore_eos=True)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with lock:
                codes.append(code)

    threads = [threading.Thread(target=one) for _ in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(codes) == 48
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert codes.count(grpc.StatusCode.OK) >= 32
    _wait_all_free(suite)


def test_text_chat_tokenize_and_model_info(suite: Suite) -> None:
    with KVMeshClient(suite.address) as client:
        info = client.model_info()
        assert info.vocab_size == 384 and info.block_size == 4 and info.has_chat_template
        ids = client.tokenize("Héllo wörld 日本語")
        text = client.stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=ids)).text
        assert text == "Héllo wörld 日本語"
        text, out_ids, final = client.complete([("user", "hello")], 6, ignore_eos=True)
        assert final.completion_tokens == 6 and len(out_ids) == 6
        # The streamed, incrementally detokenized text equals detokenizing all ids at once.
        assert text == client.stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=out_ids)).text


def test_seeded_sampling_and_logprobs_over_the_api(suite: Suite) -> None:
    prompt = list(range(30, 50))
    with KVMeshClient(suite.address) as client:
        runs = [client.complete(prompt, 6, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)[1]
                for _ in range(2)]
        other = client.complete(prompt, 6, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)[1]
        chunks = list(client.generate(prompt, 4, logprobs=3, ignore_eos=True))
    assert runs[0] == runs[1] and len(runs[0]) == 6
    assert other != runs[0]
    lps = [lp for c in chunks for lp in c.logprobs]
    ids = [t for c in chunks for t in c.token_ids]
    assert len(lps) == len(ids) == 4
    for lp, tok in zip(lps, ids, strict=True):
        assert lp.sampled.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.top[0].token_id == tok  # greedy: the sampled token is the most likely one
        assert lp.sampled.logprob == pytest.approx(lp.top[0].logprob)


def test_async_client_equals_the_sync_client_and_sends_every_sampling_field(suite: Suite) -> None:
    """The asyncio client streams the same greedy tokens as the sync one, cancels on an early exit,
    and carries min_p / penalties to the server (an out-of-range value is refused naming it)."""
    import asyncio

    from services.scheduler.client import AsyncKVMeshClient

    prompt = list(range(60, 90))
    with KVMeshClient(suite.address) as client:
        sync_ids = client.complete(prompt, 6, ignore_eos=True)[1]
        penalized = client.complete(prompt, 6, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                                    frequency_penalty=0.5, min_p=0.05)[1]

    async def run() -> tuple[list[int], list[int], int, grpc.StatusCode, str]:
        async with AsyncKVMeshClient(suite.address) as aclient:
            _text, ids, final = await aclient.complete(prompt, 6, ignore_eos=True)
            assert final.completion_tokens == 6
            same_penalized = (await aclient.complete(prompt, 6, ignore_eos=True, repetition_penalty=1.3,
                                                     presence_penalty=0.5, frequency_penalty=0.5, min_p=0.05))[1]
            seen = 0
            async for chunk in aclient.generate(prompt, 64, ignore_eos=True):
                seen += len(chunk.token_ids)
                if seen >= 2:
                    break  # leaving the loop cancels the request: its blocks must be freed
            try:
                await aclient.complete(prompt, 4, min_p=1.5)
            except grpc.aio.AioRpcError as exc:
                return ids, same_penalized, seen, exc.code(), exc.details() or ""
            raise AssertionError("min_p=1.5 was accepted")

    ids, same_penalized, seen, code, details = asyncio.run(run())
    assert ids == sync_ids and len(ids) == 6
    assert same_penalized == penalized
    assert seen == 2
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "min_p" in details
    stats = _wait_all_free(suite)
    assert stats.num_free_blocks == stats.num_blocks
