"""Both directions of every model-runner message (convert.py): a round trip returns the value, and
``RunnerInfo`` is built from ``ModelInfo`` in one place for both adapters."""

from __future__ import annotations

from services.model_runner import convert
from services.model_runner.client import RunnerInfo
from services.model_runner.types import (
    CachedRequestData,
    ModelInfo,
    NewRequestData,
    SampledLogprobs,
    SampledToken,
    StepInput,
    StepOutput,
    TokenLogprob,
)
from shared.sampling_params import SamplingParams

INFO = ModelInfo(model_id="m", architecture="LlamaForCausalLM", vocab_size=370, max_model_len=256,
                 eos_token_ids=(2, 3), bos_token_id=1, num_blocks=48, block_size=4, num_layers=2, num_kv_heads=2,
                 head_dim=16, dtype="float32", kv_cache_dtype="float32", attention_backend="torch",
                 bytes_per_block=2048, device="cpu", dtype_reason="forced", attention_backend_reason="asked",
                 pool_id="pool-7")


def test_model_info_round_trips_and_runner_info_is_its_view() -> None:
    assert convert.model_info_from_proto(convert.model_info_to_proto(INFO)) == INFO
    assert RunnerInfo.from_model_info(INFO) == RunnerInfo(
        model_id="m", vocab_size=370, max_model_len=256, eos_token_ids=(2, 3), num_blocks=48, block_size=4,
        pool_id="pool-7", dtype="float32", attention_backend="torch", dtype_reason="forced",
        attention_backend_reason="asked")


def test_step_and_output_round_trip() -> None:
    step = StepInput(step_id=3,
                     new_requests=(NewRequestData("a", (5, 6, 7), 3, (1, 2), 0, 3, SamplingParams(temperature=0.5)),),
                     cached_requests=(CachedRequestData("b", (4,), 8, 1),), finished_request_ids=("c",))
    assert convert.step_from_proto(convert.step_to_proto(step)) == step
    out = StepOutput(3, (SampledToken("a", 9, SampledLogprobs(TokenLogprob(9, -0.5), (TokenLogprob(9, -0.5),
                                                                                       TokenLogprob(4, -1.25)))),
                         SampledToken("b", 4)), forward_seconds=0.25)
    assert convert.output_from_proto(convert.output_to_proto(out)) == out
