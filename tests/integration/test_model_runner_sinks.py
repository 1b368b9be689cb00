"""The model-runner process in attention-sinks mode, set from its environment: GetModelInfo reports the
group's window and sink tokens and the unbounded max_model_len over gRPC, and a step whose table has
the freed middle as 0s and is longer than the pool runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.model_runner.config import RunnerConfig
from shared.config import from_env
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import model_runner_pb2 as pb
from shared.pb.kvmesh.v1 import model_runner_pb2_grpc as pb_grpc

BLOCK = 4
ENV = {"KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK), "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(12 * 2048),
       "KVMESH_RUNNER_WARMUP": "0", "KVMESH_RUNNER_DTYPE": "float32", "KVMESH_RUNNER_STREAMING_SINKS": "4",
       "KVMESH_RUNNER_STREAMING_WINDOW": "16"}


@pytest.fixture(scope="module")
def stub(tiny_llama_dir: Path) -> Iterator[pb_grpc.ModelRunnerStub]:
    proc = ServiceProcess("model-runner", env={"KVMESH_MODEL_DIR": str(tiny_llama_dir), **ENV})
    yield pb_grpc.ModelRunnerStub(grpc.insecure_channel(proc.address))
    proc.stop()


def test_model_info_says_sinks_and_a_long_sparse_table_runs(stub: pb_grpc.ModelRunnerStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (list(info.kv_group_windows), list(info.kv_group_sink_tokens)) == ([16], [4])
    assert (info.max_model_len, info.num_blocks, info.attention_backend) == (2**31 - 1, 12, "torch")
    assert info.attention_backend_reason == "auto: attention sinks (streaming_sinks) run on the torch backend only"
    tokens = [(7 * i) % 300 + 3 for i in range(60)]  # 15 blocks: more than the pool's 11
    first = pb.NewRequestData(request_id="a", token_ids=tokens, num_prompt_tokens=60,
                              block_ids=[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3, 4, 5, 6], num_computed_tokens=56,
                              num_new_tokens=4, sampling=common_pb2.SamplingParams())
    out = stub.Execute(pb.ExecuteRequest(step_id=1, new_requests=[first]))
    assert [s.request_id for s in out.sampled] == ["a"]
    stub.Execute(pb.ExecuteRequest(step_id=2, finished_request_ids=["a"]))
    bad = pb.NewRequestData(request_id="b", token_ids=tokens, num_prompt_tokens=60,
                            block_ids=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3, 4, 5, 6], num_computed_tokens=56,
                            num_new_tokens=4, sampling=common_pb2.SamplingParams())
    with pytest.raises(grpc.RpcError) as err:  # the sink block must be a real one
        stub.Execute(pb.ExecuteRequest(step_id=3, new_requests=[bad]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_environment_wants_both_or_neither() -> None:
    assert from_env(RunnerConfig, "KVMESH_RUNNER_", ENV).streaming_window == 16
    with pytest.raises(ValueError, match="must both be > 0"):
        from_env(RunnerConfig, "KVMESH_RUNNER_", {"KVMESH_RUNNER_STREAMING_SINKS": "4"})
