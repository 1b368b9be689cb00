"""An MLA model (tiny random DeepSeek-V3) served by a real model-runner process with the default
settings: GetModelInfo over gRPC says the latent layout and its bytes per token, ``auto`` picked
torch and float32, and greedy steps (a prefill, then decodes into a new block) equal transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.kv_layout import mla_kv_bytes_per_token
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import model_runner_pb2 as pb
from shared.pb.kvmesh.v1 import model_runner_pb2_grpc as pb_grpc
from tests.unit.model_runner.mla_checkpoints import build_deepseek

BLOCK = 4


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek(tmp_path_factory.mktemp("ds_qlora"), "ds_qlora")


@pytest.fixture(scope="module")
def stub(deepseek_dir: Path) -> Iterator[pb_grpc.ModelRunnerStub]:
    env = {"KVMESH_MODEL_DIR": str(deepseek_dir), "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
           "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(32 * BLOCK * 480), "KVMESH_RUNNER_WARMUP": "1",
           "KVMESH_RUNNER_DTYPE": "auto", "KVMESH_RUNNER_ATTENTION_BACKEND": "auto"}  # fmt: skip
    proc = ServiceProcess("model-runner", env=env)
    yield pb_grpc.ModelRunnerStub(grpc.insecure_channel(proc.address))
    proc.stop()


def test_model_info_and_greedy_steps_over_grpc(stub: pb_grpc.ModelRunnerStub, deepseek_dir: Path) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.kv_layout, info.kv_bytes_per_token) == ("mla", mla_kv_bytes_per_token(3, 32, 8, 4))
    assert (info.num_kv_heads, info.head_dim, info.num_blocks, info.bytes_per_block) == (1, 40, 32, BLOCK * 480)
    assert (info.dtype, info.attention_backend) == ("float32", "torch")
    assert info.attention_backend_reason == "auto: MLA (latent KV) runs on the torch backend only"
    prompt = list(range(10, 21))  # 11 tokens -> 3 blocks, then decodes fill the third and a fourth
    new = pb.NewRequestData(request_id="a", token_ids=prompt, num_prompt_tokens=11, block_ids=[1, 2, 3],
                            num_computed_tokens=0, num_new_tokens=11, sampling=common_pb2.SamplingParams())
    tokens = [stub.Execute(pb.ExecuteRequest(step_id=1, new_requests=[new])).sampled[0].token_id]
    for step, computed in enumerate(range(11, 15), start=2):
        cached = pb.CachedRequestData(request_id="a", new_block_ids=[4] if computed == 12 else [],
                                      num_computed_tokens=computed, num_new_tokens=1)
        tokens.append(stub.Execute(pb.ExecuteRequest(step_id=step, cached_requests=[cached])).sampled[0].token_id)
    model = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 11, dtype=torch.long),
                         max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 11:].tolist()  # fmt: skip
    assert tokens == ref
