"""Prefill/decode disaggregation: which requests are split in two legs, and how the legs join (no grpc).

Conditional disaggregation, as Dynamo does it (docs/mesh.md, "Prefill/decode"): a request goes
first to a ``prefill`` replica only when its **uncached** prompt on the best decode candidate
(prompt blocks minus the blocks the indexes say that replica holds in its pool or would load
from its offload tiers, the shared remote one included) is longer than
``pd_threshold_tokens`` and a prefill replica is healthy (and not over
``pd_max_prefill_in_flight``); anything else goes whole to a decode (or mixed) replica.

Leg 1 is the request with ``max_tokens=1`` on the prefill replica, which publishes the prompt's full
blocks to the shared remote tier before its one token leaves (``KVMESH_SCHED_ROLE=prefill``); that
token is passed to the client at once. Leg 2 is the prompt's token ids plus that token, with the
budget left, on a decode replica: its ordinary offload lookup finds the blocks in the remote tier
(a miss of any kind is a recompute). The client sees one stream: leg 1's final chunk is dropped,
leg 2's counts the original prompt and every token.

Why some requests are never split (``refusal``): the decode replica cannot continue exactly what
one replica would have done when the state that decides the next token is more than the tokens:

* a **seeded** request that samples (temperature > 0): its generator draws once per token from the
  seed (services/model_runner/sampler.py); leg 2 would start the draws again at the seed, so its
  second token would use the first draw. Unseeded sampling has no stream to keep (any draw is as
  good); greedy draws nothing.
* **presence / frequency penalties** count output tokens only; in leg 2 the first token is part of
  the prompt, so it would not be penalised. (The repetition penalty covers prompt and output
  alike, so it is unchanged.)
* **stop strings**: the decode replica matches them in its own output's text, so one that starts
  in the first token's text would be missed.
* ``max_tokens`` = 1: there is nothing to hand over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from services.router.types import Decision, ReplicaAddress
from shared.pb.kvmesh.v1 import scheduler_pb2

log = logging.getLogger(__name__)

PREFILL = "prefill"


class RoleCandidate(Protocol):
    """What the split needs of a replica (``client.Replica`` is one)."""

    address: ReplicaAddress

    @property
    def in_flight(self) -> int: ...


R = TypeVar("R", bound=RoleCandidate)


def split_roles(replicas: Sequence[R]) -> tuple[list[R], list[R]]:
    """(prefill replicas, the rest): only the rest serve whole requests and second legs."""
    prefill = [r for r in replicas if r.address.role == PREFILL]
    return prefill, [r for r in replicas if r.address.role != PREFILL]


def refusal(request: scheduler_pb2.GenerateRequest) -> str:
    """Why this request must not be split (the module docstring); '' when it may be."""
    s = request.sampling
    if request.max_tokens <= 1:
        return "max_tokens <= 1"
    if s.temperature > 0 and s.HasField("seed"):
        return "seeded sampling"
    if s.presence_penalty or s.frequency_penalty:
        return "presence/frequency penalty"
    if request.stop:
        return "stop strings"
    return ""


def uncached_tokens(decision: Decision, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens the best decode candidate would have to compute itself.

    Blocks its offload-store would load count as cached: its DRAM and disk, and the shared remote
    tier (a prompt a prefill replica already published is not prefilled again).
    """
    held = decision.matched_blocks + decision.offload.total
    return max(num_prompt_tokens - held * block_size, 0)


def leg1_request(request: scheduler_pb2.GenerateRequest, prompt_ids: Sequence[int]) -> scheduler_pb2.GenerateRequest:
    """The prefill leg: the same request on the router's token ids, one token."""
    leg = scheduler_pb2.GenerateRequest()
    leg.CopyFrom(request)
    leg.token_ids.ids[:] = list(prompt_ids)
    leg.max_tokens = 1
    return leg


def leg2_request(request: scheduler_pb2.GenerateRequest, prompt_ids: Sequence[int], first: Sequence[int],
                 request_id: str) -> scheduler_pb2.GenerateRequest:
    """The decode leg: prompt + the first token(s) as the prompt, the budget left, the same id."""
    leg = scheduler_pb2.GenerateRequest()
    leg.CopyFrom(request)
    leg.token_ids.ids[:] = [*prompt_ids, *first]
    leg.max_tokens = request.max_tokens - len(first)
    leg.request_id = request_id
    return leg


Leg = Callable[[scheduler_pb2.GenerateRequest], Iterator[scheduler_pb2.GenerateResponse]]


def two_legs(request: scheduler_pb2.GenerateRequest, prompt_ids: Sequence[int], prefill: Leg, decode: Leg,
             prefill_failed: Callable[[Exception], bool]) -> Iterator[scheduler_pb2.GenerateResponse]:
    """The client's one stream over both legs.

    Args:
        prefill: opens leg 1 on the chosen prefill replica.
        decode: opens a request on the decode candidates (with the usual fail-over).
        prefill_failed: called with leg 1's error; True: carry on without it (the decode replica
            recomputes what is missing), False: re-raise (the caller's answer, e.g. bad input).
    """
    start = time.monotonic()
    first: list[int] = []
    request_id = request.request_id
    final1: scheduler_pb2.GenerateFinal | None = None
    ttft = 0.0
    try:
        for msg in prefill(leg1_request(request, prompt_ids)):
            request_id = request_id or msg.request_id
            if msg.HasField("final"):
                final1 = msg.final
            if msg.token_ids:
                first.extend(msg.token_ids)
                ttft = ttft or time.monotonic() - start
                out = scheduler_pb2.GenerateResponse()
                out.CopyFrom(msg)
                out.ClearField("final")  # the stream goes on on the decode replica
                yield out
    except Exception as exc:
        if not prefill_failed(exc):
            raise
    if first and final1 is not None and final1.finish_reason == scheduler_pb2.FINISH_REASON_STOP:
        yield scheduler_pb2.GenerateResponse(request_id=request_id, final=final1)  # EOS / stop token: done
        return
    if not first:
        log.info("prefill leg gave no token, request %s goes whole to a decode replica", request_id or "-")
        yield from decode(request)
        return
    for msg in decode(leg2_request(request, prompt_ids, first, request_id)):
        msg.request_id = request_id
        if msg.HasField("final"):
            f = msg.final
            f.prompt_tokens = len(prompt_ids)
            f.completion_tokens += len(first)
            f.cached_tokens = min(f.cached_tokens, len(prompt_ids))
            f.timing.ttft_seconds = ttft
            f.timing.e2e_seconds = time.monotonic() - start
        yield msg
