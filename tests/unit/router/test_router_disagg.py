"""The disaggregation core: the replica list's roles, which requests may be split, and how the
two legs' real protobuf streams are joined into one (services/router/disagg.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.router import disagg
from services.router.config import RouterConfig
from services.router.types import ReplicaAddress
from shared.pb.kvmesh.v1 import scheduler_pb2 as pb
from shared.pb.kvmesh.v1.common_pb2 import SamplingParams


def test_replica_list_carries_roles() -> None:
    cfg = RouterConfig(replicas="p=h:1/h:2/prefill,d=h:3/h:4/decode,h:5/h:6")
    assert cfg.replica_addresses() == (ReplicaAddress("p", "h:1", "h:2", "prefill"),
                                       ReplicaAddress("d", "h:3", "h:4", "decode"),
                                       ReplicaAddress("r2", "h:5", "h:6", "mixed"))
    with pytest.raises(ValueError, match="role must be one of"):
        RouterConfig(replicas="a=h:1/h:2/prefil")
    with pytest.raises(ValueError, match="expected"):
        RouterConfig(replicas="a=h:1/h:2/prefill/x")


def _req(**kw: object) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_tokens=8, **kw)  # type: ignore[arg-type]
    req.token_ids.ids[:] = [5, 6, 7]
    return req


def test_refusals_name_the_reason() -> None:
    assert disagg.refusal(_req()) == ""
    assert disagg.refusal(_req(sampling=SamplingParams(temperature=0.0, seed=3))) == ""  # greedy: no draws
    assert disagg.refusal(_req(sampling=SamplingParams(temperature=0.7))) == ""  # unseeded
    assert disagg.refusal(_req(sampling=SamplingParams(temperature=0.7, seed=3))) == "seeded sampling"
    assert disagg.refusal(_req(sampling=SamplingParams(frequency_penalty=0.5))) == "presence/frequency penalty"
    assert disagg.refusal(_req(stop=["x"])) == "stop strings"
    assert disagg.refusal(pb.GenerateRequest(max_tokens=1)) == "max_tokens <= 1"


def _final(reason: int, prompt: int, completion: int, cached: int) -> pb.GenerateFinal:
    return pb.GenerateFinal(finish_reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                            cached_tokens=cached)  # type: ignore[arg-type]


def test_two_legs_make_one_stream_with_one_final() -> None:
    seen: list[pb.GenerateRequest] = []

    def prefill(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        seen.append(req)
        yield pb.GenerateResponse(request_id="id1", token_ids=[42], text="a",
                                  final=_final(pb.FINISH_REASON_LENGTH, 3, 1, 0))

    def decode(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        seen.append(req)
        yield pb.GenerateResponse(request_id="other", token_ids=[43], text="b")
        yield pb.GenerateResponse(request_id="other", token_ids=[44], text="c",
                                  final=_final(pb.FINISH_REASON_LENGTH, 4, 7, 4))

    out = list(disagg.two_legs(_req(), [5, 6, 7], prefill, decode, lambda exc: True))
    assert [list(m.token_ids) for m in out] == [[42], [43], [44]]
    assert [m.HasField("final") for m in out] == [False, False, True]
    assert {m.request_id for m in out} == {"id1"}
    f = out[-1].final
    assert (f.prompt_tokens, f.completion_tokens, f.cached_tokens) == (3, 8, 3)
    assert (list(seen[0].token_ids.ids), seen[0].max_tokens) == ([5, 6, 7], 1)
    assert (list(seen[1].token_ids.ids), seen[1].max_tokens, seen[1].request_id) == ([5, 6, 7, 42], 7, "id1")


def test_eos_in_the_first_leg_ends_the_stream() -> None:
    def prefill(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id="id1", token_ids=[2], final=_final(pb.FINISH_REASON_STOP, 3, 1, 0))

    def decode(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        raise AssertionError("no second leg after EOS")

    out = list(disagg.two_legs(_req(), [5, 6, 7], prefill, decode, lambda exc: True))
    assert [list(m.token_ids) for m in out] == [[2], []]
    assert out[-1].final.finish_reason == pb.FINISH_REASON_STOP


def test_a_failed_first_leg_sends_the_whole_request_or_reraises() -> None:
    def prefill(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        raise RuntimeError("down")
        yield pb.GenerateResponse()

    whole: list[pb.GenerateRequest] = []

    def decode(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        whole.append(req)
        yield pb.GenerateResponse(token_ids=[9], final=_final(pb.FINISH_REASON_LENGTH, 3, 8, 0))

    original = _req()
    out = list(disagg.two_legs(original, [5, 6, 7], prefill, decode, lambda exc: True))
    assert whole == [original] and out[-1].final.completion_tokens == 8
    with pytest.raises(RuntimeError, match="down"):
        list(disagg.two_legs(original, [5, 6, 7], prefill, decode, lambda exc: False))
