"""What the planner hands on: the step it planned (and the runner's input for it), what a step produced.

:func:`build_step` turns the allocation results of the requests that run into the model-runner's
``StepInput``: a request new to the runner is sent in full once (``NewRequestData``), a known one
as a diff (``CachedRequestData``), as vLLM v1's ``SchedulerOutput`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kv_cache_manager.types import AllocationResult, KVCacheStats
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from services.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    """One planned step: who computes how many tokens, and what the runner must be told."""

    step_input: StepInput
    num_scheduled: dict[str, int]  # request id -> tokens computed this step
    preempted: list[str] = field(default_factory=list)
    kv_stats: KVCacheStats | None = None
    # False for a step sent ahead (lookahead.py): it ran on slots already held, no allocation was
    # asked, so it renewed no kv-cache-manager lease.
    allocated: bool = True

    @property
    def total_tokens(self) -> int:
        """Tokens computed in the step."""
        return sum(self.num_scheduled.values())


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request."""

    request: Request
    token_id: int
    finished: bool
    logprobs: object | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id


def split_groups(block_ids: tuple[int, ...], num_groups: int) -> list[list[int]]:
    """Group-major block ids (G equal runs, the kv-cache-manager's order) -> one list per group."""
    n = len(block_ids) // num_groups
    return [list(block_ids[g * n : (g + 1) * n]) for g in range(num_groups)]


def build_step(step_id: int, scheduled: list[tuple[Request, AllocationResult]],
               admitted: list[tuple[Request, AllocationResult]], preempted: list[str],
               finished_request_ids: list[str], kv_stats: KVCacheStats | None,
               num_groups: int = 1) -> ScheduledStep:
    """Records each request's new blocks and builds the runner's input for the step.

    Block ids stay group-major on the way to the runner, exactly as the kv-cache-manager sent them
    (a new request's G tables, a running request's G runs of new ids).

    Args:
        scheduled: running requests granted their slots (diffs for the runner).
        admitted: requests admitted this step (sent in full); one preempted since is skipped.
        finished_request_ids: requests the runner must forget first.
        num_groups: KV cache groups (block tables per request).
    """
    new_reqs: list[NewRequestData] = []
    cached: list[CachedRequestData] = []
    num_scheduled: dict[str, int] = {}
    for req, res in scheduled:
        num_new = res.num_new_tokens - req.num_unreported_tokens  # the manager caught up (scheduler.py)
        req.num_unreported_tokens = 0
        cached.append(CachedRequestData(
            request_id=req.request_id, new_block_ids=tuple(res.new_block_ids),
            num_computed_tokens=req.num_computed_tokens, num_new_tokens=num_new,
        ))
        if num_groups == 1:
            req.block_tables[0].extend(res.new_block_ids)
        elif res.new_block_ids:
            for table, run in zip(req.block_tables, split_groups(res.new_block_ids, num_groups), strict=True):
                table.extend(run)
        req.num_tokens_sent_to_kvm = req.num_tokens
        num_scheduled[req.request_id] = num_new
    for req, res in admitted:
        if req.is_finished or req.status is not RequestStatus.RUNNING:
            continue
        req.block_tables = split_groups(res.new_block_ids, num_groups)
        req.num_computed_tokens = res.num_computed_tokens
        req.num_tokens_sent_to_kvm = req.num_tokens
        req.known_to_runner = True
        new_reqs.append(NewRequestData(
            request_id=req.request_id, token_ids=tuple(req.all_token_ids()),
            num_prompt_tokens=req.num_prompt_tokens, block_ids=tuple(res.new_block_ids),
            num_computed_tokens=req.num_computed_tokens, num_new_tokens=res.num_new_tokens,
            sampling=req.spec.sampling,
        ))
        num_scheduled[req.request_id] = res.num_new_tokens
    step_input = StepInput(step_id=step_id, new_requests=tuple(new_reqs), cached_requests=tuple(cached),
                           finished_request_ids=tuple(finished_request_ids))
    return ScheduledStep(step_input, num_scheduled, preempted, kv_stats)
