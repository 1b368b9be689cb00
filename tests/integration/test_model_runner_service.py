"""The model-runner as a real process over gRPC: model info, steps, bad input, the shared pool
handle (mapped zero-copy from this process), block copies through a staging buffer, and the pool
file removed on SIGTERM."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.model_runner.kv_pool import attach
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import model_runner_pb2 as pb
from shared.pb.kvmesh.v1 import model_runner_pb2_grpc as pb_grpc
from shared.tensor_handle import SharedTensorHandle, handle_from_proto, handle_to_proto

BLOCK = 4
# The exact reference mode the transformers comparison needs (the defaults are per machine).
REFERENCE_MODE = {"KVMESH_RUNNER_DTYPE": "float32", "KVMESH_RUNNER_ATTENTION_BACKEND": "torch"}


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> Iterator[tuple[ServiceProcess, pb_grpc.ModelRunnerStub]]:
    env = {"KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
           "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(32 * 2048), "KVMESH_RUNNER_WARMUP": "0",
           **REFERENCE_MODE}
    proc = ServiceProcess("model-runner", env=env)
    yield proc, pb_grpc.ModelRunnerStub(grpc.insecure_channel(proc.address))
    proc.stop()


def _new(rid: str, tokens: list[int], blocks: list[int]) -> pb.NewRequestData:
    return pb.NewRequestData(request_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens), block_ids=blocks,
                             num_computed_tokens=0, num_new_tokens=len(tokens),
                             sampling=common_pb2.SamplingParams())


def test_info_and_greedy_steps_match_transformers(runner: tuple[ServiceProcess, pb_grpc.ModelRunnerStub],
                                                  tiny_llama_dir: Path) -> None:
    _, stub = runner
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_blocks, info.block_size, info.vocab_size) == (32, BLOCK, 384)
    assert info.attention_backend == "torch" and info.device == "cpu" and info.bytes_per_block == 2048
    assert (info.dtype, info.dtype_reason, info.attention_backend_reason) == ("float32", "set explicitly",
                                                                              "set explicitly")
    prompt = list(range(10, 21))  # 11 tokens -> 3 blocks, then decodes fill the third and a fourth
    out = stub.Execute(pb.ExecuteRequest(step_id=1, new_requests=[_new("a", prompt, [1, 2, 3])]))
    tokens = [out.sampled[0].token_id]
    computed = len(prompt)
    for step in range(2, 6):
        new_blocks = [4] if computed == 12 else []
        out = stub.Execute(pb.ExecuteRequest(step_id=step, cached_requests=[pb.CachedRequestData(
            request_id="a", new_block_ids=new_blocks, num_computed_tokens=computed, num_new_tokens=1)]))
        computed += 1
        tokens.append(out.sampled[0].token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 11:].tolist()
    assert tokens == ref
    stub.Execute(pb.ExecuteRequest(step_id=6, finished_request_ids=["a"]))


@pytest.mark.parametrize(("name", "step"), [
    ("token outside the vocabulary", pb.ExecuteRequest(step_id=9, new_requests=[_new("b", [3, 384], [1])])),
    ("block outside the pool", pb.ExecuteRequest(step_id=9, new_requests=[_new("b", [3, 4], [32])])),
    ("unknown cached request", pb.ExecuteRequest(step_id=9, cached_requests=[pb.CachedRequestData(
        request_id="nobody", num_computed_tokens=3, num_new_tokens=1)])),
    ("too few blocks for the tokens", pb.ExecuteRequest(step_id=9, new_requests=[_new("b", list(range(3, 12)), [1])])),
])
def test_bad_steps_are_invalid_and_the_runner_keeps_serving(
        runner: tuple[ServiceProcess, pb_grpc.ModelRunnerStub], name: str, step: pb.ExecuteRequest) -> None:
    _, stub = runner
    with pytest.raises(grpc.RpcError) as info:
        stub.Execute(step)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    ok = stub.Execute(pb.ExecuteRequest(step_id=10, new_requests=[_new("c", [5, 6, 7], [5])]))
    assert len(ok.sampled) == 1
    stub.Execute(pb.ExecuteRequest(step_id=11, finished_request_ids=["c"]))


def _decode(step_id: int, computed: int, after: int = 0, new_blocks: tuple[int, ...] = ()) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(step_id=step_id, after_step_id=after, cached_requests=[pb.CachedRequestData(
        request_id="d", new_block_ids=list(new_blocks), num_computed_tokens=computed, num_new_tokens=1)])


def test_a_step_sent_ahead_runs_right_after_the_one_it_follows(
        runner: tuple[ServiceProcess, pb_grpc.ModelRunnerStub], tiny_llama_dir: Path) -> None:
    """Async scheduling: step N + 1 may reach the runner before step N; it waits for N, takes N's
    sampled token as its input, and is refused (changing nothing) when N failed."""
    _, stub = runner
    prompt = list(range(30, 40))  # 10 tokens in blocks 1-3: positions 10 and 11 fit, 12 needs block 4
    first = stub.Execute(pb.ExecuteRequest(step_id=20, new_requests=[_new("d", prompt, [1, 2, 3])]))
    tokens = [first.sampled[0].token_id]
    ahead = stub.Execute.future(_decode(22, 11, after=21))  # sent first: waits for step 21
    with pytest.raises(grpc.FutureTimeoutError):
        ahead.result(timeout=0.5)
    tokens.append(stub.Execute(_decode(21, 10)).sampled[0].token_id)
    tokens.append(ahead.result(timeout=30).sampled[0].token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 10:].tolist()
    assert tokens == ref[:3]

    # Step 23 is refused (it names a computed count the runner does not have): 24, sent after it,
    # is refused too, and the runner's state is the one step 22 left.
    ahead = stub.Execute.future(_decode(24, 13, after=23, new_blocks=(4,)))
    with pytest.raises(grpc.RpcError) as bad:
        stub.Execute(_decode(23, 99, new_blocks=(4,)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as refused:
        ahead.result(timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 23, which this step follows, failed" in (refused.value.details() or "")
    assert stub.Execute(_decode(25, 12, new_blocks=(4,))).sampled[0].token_id == ref[3]
    stub.Execute(pb.ExecuteRequest(step_id=26, finished_request_ids=["d"]))


def test_pool_handle_maps_zero_copy_and_blocks_copy_through_staging(
        runner: tuple[ServiceProcess, pb_grpc.ModelRunnerStub]) -> None:
    _, stub = runner
    handle = handle_from_proto(stub.GetKVPoolHandle(pb.GetKVPoolHandleRequest()))
    pool = attach(handle)  # [layers, 2, blocks, block_size, kv_heads, head_dim], the runner's memory
    assert tuple(pool.shape) == (2, 2, 32, BLOCK, 2, 16)
    pool[:, :, 7].fill_(1.5)  # written here, seen by the runner (copied out below)
    shape = (2, 2, 2, BLOCK, 2, 16)  # staging: [n, layers, 2, block_size, kv_heads, head_dim]
    path = f"/dev/shm/kvmesh-test-staging-{uuid.uuid4().hex}"
    nbytes = math.prod(shape) * 4
    staging = torch.from_file(path, shared=True, size=math.prod(shape), dtype=torch.float32).view(shape)
    try:
        msg = handle_to_proto(SharedTensorHandle(kind="shm_file", dtype="float32", shape=shape, nbytes=nbytes,
                                                 path=path))
        resp = stub.CopyBlocksOut(pb.CopyBlocksRequest(block_ids=[7], staging=msg, staging_rows=[1]))
        assert (resp.num_blocks, resp.num_bytes) == (1, 2048)
        assert torch.equal(staging[1], torch.full_like(staging[1], 1.5))
        staging[0].fill_(-2.0)
        stub.CopyBlocksIn(pb.CopyBlocksRequest(block_ids=[9], staging=msg, staging_rows=[0]))
        assert torch.equal(pool[:, :, 9], torch.full_like(pool[:, :, 9], -2.0))
        with pytest.raises(grpc.RpcError) as info:
            stub.CopyBlocksIn(pb.CopyBlocksRequest(block_ids=[0], staging=msg, staging_rows=[0]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the null block is never written
    finally:
        os.unlink(path)


def test_sigterm_removes_the_pool_file(tiny_llama_dir: Path) -> None:
    env = {"KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
           "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(8 * 2048), "KVMESH_RUNNER_WARMUP": "0",
           **REFERENCE_MODE}
    proc = ServiceProcess("model-runner", env=env)
    stub = pb_grpc.ModelRunnerStub(grpc.insecure_channel(proc.address))
    path = Path(stub.GetKVPoolHandle(pb.GetKVPoolHandleRequest()).path)
    assert path.exists()
    assert proc.stop() == 0
    assert not path.exists()
