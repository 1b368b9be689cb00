"""Protobuf <-> dataclass conversions used on both sides of more than one service boundary."""

from __future__ import annotations

from collections.abc import Sequence

from shared.pb.kvmesh.v1 import common_pb2
from shared.sampling_params import SampledLogprobs, SamplingParams, TokenLogprob


def sampling_from_proto(
    msg: common_pb2.SamplingParams, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False
) -> SamplingParams:
    """Reads proto sampling parameters; unset optional fields take their neutral defaults.

    NaN and out-of-range values are kept as sent so that ``SamplingParams.validate`` can name them.
    """
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=ignore_eos,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Writes sampling parameters (stop ids and ignore_eos travel outside this message)."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def logprobs_to_proto(lp: SampledLogprobs) -> common_pb2.SampledLogprobs:
    """A logprobs dataclass as its proto message (the runner's step output, the scheduler's chunks)."""
    return common_pb2.SampledLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=lp.sampled.token_id, logprob=lp.sampled.logprob),
        top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
    )


def logprobs_from_proto(msg: common_pb2.SampledLogprobs) -> SampledLogprobs:
    """A proto logprobs message as the dataclass."""
    return SampledLogprobs(
        sampled=TokenLogprob(msg.sampled.token_id, msg.sampled.logprob),
        top=tuple(TokenLogprob(t.token_id, t.logprob) for t in msg.top),
    )
