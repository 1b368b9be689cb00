"""The scheduler's converters: every field of every message survives a round trip, both ways."""

from __future__ import annotations

import pytest

from services.model_runner.types import SampledLogprobs, TokenLogprob
from services.scheduler.convert import (
    chunk_from_proto,
    chunk_to_proto,
    generate_request_from_proto,
    generate_request_to_proto,
    model_info_from_proto,
    model_info_to_proto,
)
from services.scheduler.request import FinishReason
from services.scheduler.types import Chunk, Final, GenerateRequest, RequestMetrics, SchedulerModelInfo
from shared.pb.kvmesh.v1 import scheduler_pb2
from shared.sampling_params import SamplingParams

# Values exact in float32 (the wire type), so equality is exact.
SAMPLING = SamplingParams(temperature=0.5, top_k=7, top_p=0.875, min_p=0.0625, repetition_penalty=1.125,
                          presence_penalty=0.25, frequency_penalty=-0.5, seed=11, logprobs=2,
                          stop_token_ids=(3, 4), ignore_eos=True)


@pytest.mark.parametrize("prompt", [
    {"text": "hello"}, {"text": ""}, {"chat": (("system", "be brief"), ("user", "hi"))}, {"chat": ()},
    {"token_ids": (1, 2, 3)}, {},
])
def test_generate_request_round_trip(prompt: dict[str, object]) -> None:
    req = GenerateRequest(**prompt, sampling=SAMPLING, max_tokens=9, stop=("\n", "END"),  # type: ignore[arg-type]
                          request_id="r1", priority=-2, cache_salt="s", include_special_tokens=True)
    msg = generate_request_to_proto(req)
    assert msg.WhichOneof("prompt") == req.prompt_kind
    assert list(msg.stop_token_ids) == [3, 4] and msg.ignore_eos
    assert generate_request_from_proto(msg) == req


def test_unset_sampling_fields_read_as_the_neutral_defaults() -> None:
    req = generate_request_from_proto(scheduler_pb2.GenerateRequest(text="x", max_tokens=1))
    assert req.sampling == SamplingParams()
    assert req.prompt_kind == "text"


def test_chunk_round_trip_with_final_and_logprobs() -> None:
    lp = SampledLogprobs(TokenLogprob(5, -0.25), (TokenLogprob(5, -0.25), TokenLogprob(9, -1.5)))
    metrics = RequestMetrics(prompt_tokens=4, completion_tokens=2, cached_tokens=16, preemptions=1,
                             queue_seconds=0.5, ttft_seconds=0.75, tpot_seconds=0.125, e2e_seconds=1.0,
                             max_itl_seconds=0.25)
    for reason in FinishReason:
        chunk = Chunk("r1", (5, 9), "ab", (lp, lp), Final(reason, "stop!", metrics))
        msg = chunk_to_proto(chunk)
        assert msg.final.finish_reason == {FinishReason.STOP: scheduler_pb2.FINISH_REASON_STOP,
                                           FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
                                           FinishReason.ABORT: scheduler_pb2.FINISH_REASON_ABORT}[reason]
        assert chunk_from_proto(msg) == chunk


def test_chunk_without_final_or_logprobs() -> None:
    chunk = Chunk("r2", (7,), "x")
    msg = chunk_to_proto(chunk)
    assert not msg.HasField("final") and not msg.logprobs
    assert chunk_from_proto(msg) == chunk


def test_a_missing_logprob_is_not_sent() -> None:
    lp = SampledLogprobs(TokenLogprob(1, -0.5), ())
    assert len(chunk_to_proto(Chunk("r", (1, 2), "", (None, lp))).logprobs) == 1


def test_model_info_round_trip() -> None:
    info = SchedulerModelInfo(model_id="m", vocab_size=100, max_model_len=64, block_size=4, num_blocks=33,
                              max_num_seqs=8, max_num_batched_tokens=128, max_logprobs=5, has_chat_template=True,
                              dtype="float32", attention_backend="torch", dtype_reason="cpu",
                              attention_backend_reason="default")
    assert model_info_from_proto(model_info_to_proto(info)) == info
