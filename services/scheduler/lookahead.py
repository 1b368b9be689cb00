"""Async scheduling: the step after an in-flight one, planned before the in-flight one returns.

While the runner computes step N, the engine plans step N + 1 from what N will leave behind and
sends it at once (``after_step_id`` = N), as vLLM's async scheduling does: the runner starts N + 1
the moment N ends, and the scheduler's own work (N's outputs, detokenizing, streaming, the RPC
round trips) overlaps the forward pass instead of sitting between two of them.

Step N + 1 needs no decision that N's sampled tokens could change, which is what keeps the answer
that of a synchronous step (docs/design.md, "Async scheduling"):

- it asks the kv-cache-manager for nothing: every request must already hold the slots of N + 1's
  tokens (a decode's next position inside its last block, a prompt's next chunk in its blocks).
  Allocations, frees, evictions, offload loads and saves happen only in synchronous steps, with
  no step in flight, so no block is freed, reused or copied while a forward pass may write it;
- it is exactly the running requests, in order, with their next tokens: no admission, nothing
  finished, preempted or aborted waiting to be freed or forgotten, no re-bind pending;
- a request that N ends by length is left out; one that N ends with a stop token (not known yet)
  computes one token more, which nobody reads: its blocks are freed after N + 1 returns, and
  the token is dropped like any token of a request that ended while its step ran.

The runner has N's tokens itself (it appends what it samples), so N + 1 carries no token ids.
The kv-cache-manager learns of N + 1's tokens with the request's next allocation
(``Request.num_unreported_tokens``).
"""

from __future__ import annotations

from services.model_runner.types import CachedRequestData, StepInput
from services.scheduler.queues import RequestQueues
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import ScheduledStep


def _samples(req: Request, num_computed: int) -> bool:
    """Whether a step that brings the request to ``num_computed`` samples a token for it."""
    return num_computed >= req.num_tokens


def plan_ahead(prev: ScheduledStep, queues: RequestQueues, step_id: int, block_size: int,
               max_model_len: int, max_num_seqs: int, token_budget: int) -> ScheduledStep | None:
    """The step to run right after ``prev`` (in flight), or None when it needs a synchronous one.

    Call it with every step before ``prev`` applied (``Scheduler.update``).

    Args:
        step_id: the id the step gets if one is planned.
        token_budget: ``max_num_batched_tokens``.
    """
    if queues.pending_frees or queues.pending_rollbacks or queues.runner_forget:
        return None
    if queues.waiting and len(queues.running) < max_num_seqs:
        return None  # an admission needs the kv-cache-manager
    cached: list[CachedRequestData] = []
    num_scheduled: dict[str, int] = {}
    budget = token_budget
    for req in queues.running:
        num_prev = prev.num_scheduled.get(req.request_id)
        if req.status is not RequestStatus.RUNNING or num_prev is None:
            return None  # not in the step in flight: its plan is the synchronous planner's
        computed = req.num_computed_tokens + num_prev
        if _samples(req, computed):
            if req.at_length(max_model_len, more=1):  # the token N samples ends it: known now
                continue
            num_new = 1
        else:
            num_new = min(req.num_tokens - computed, budget)
        if num_new <= 0 or -(-(computed + num_new) // block_size) > len(req.block_tables[0]):
            return None  # out of budget, or it needs a block: a synchronous step allocates
        budget -= num_new
        cached.append(CachedRequestData(request_id=req.request_id, new_block_ids=(),
                                        num_computed_tokens=computed, num_new_tokens=num_new))
        num_scheduled[req.request_id] = num_new
    if not cached:
        return None
    for c in cached:
        queues.requests[c.request_id].num_unreported_tokens += c.num_new_tokens
    step_input = StepInput(step_id=step_id, cached_requests=tuple(cached), after_step_id=prev.step_input.step_id)
    return ScheduledStep(step_input, num_scheduled, allocated=False)
