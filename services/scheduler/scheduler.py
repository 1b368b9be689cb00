"""The step planner: continuous batching, chunked prefill, prefix caching and preemption.

Each call to :meth:`Scheduler.schedule` builds one step:

1. running requests first, in the order they started: each gets
   ``min(num_tokens - num_computed_tokens, budget left)`` tokens (1 for a decode, a chunk for a
   prompt still being read);
2. then waiting requests in (priority, arrival) order while the token budget, ``max_num_seqs``
   and the pool allow (a prefix-cache hit is applied by the kv-cache-manager and shrinks the
   work, never grows it);
3. the whole step goes to the kv-cache-manager as **one** batched call (frees of finished or
   preempted requests first). Only if a running request is refused for lack of blocks does the
   scheduler preempt — the newest request first — and retry that request.

The result is a :class:`ScheduledStep` from which the runner's ``StepInput`` is built;
:meth:`Scheduler.update` applies the sampled tokens, checks stop conditions and retires requests.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.kv_cache_manager.client import KVCacheBackend
from services.kv_cache_manager.types import (
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    KVCacheStats,
    StepResult,
)
from services.model_runner.client import RunnerInfo
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput, StepOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.offload import OffloadConnector
from services.scheduler.request import FinishReason, Request, RequestStatus
from shared.errors import InvalidArgument
from shared.hashing import BlockHash, hash_blocks

log = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    """One planned step: who computes how many tokens, and what the runner must be told."""

    step_input: StepInput
    num_scheduled: dict[str, int]  # request id -> tokens computed this step
    preempted: list[str] = field(default_factory=list)
    kv_stats: KVCacheStats | None = None

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


class Scheduler:
    """Owns the waiting and running queues and the per-request state; decides each step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheBackend, info: RunnerInfo,
                 offload: OffloadConnector | None = None, hash_seed: bytes = b"") -> None:
        """Args:
            offload: the offload-store connector, or None to run without the offload tier.
            hash_seed: the prefix-hash chain root. The scheduler is its one owner: it hashes each
                request's full blocks once (offload keys, and the kv-cache-manager's prefix map,
                which receives them with every allocation and never hashes).
        """
        self.config = config
        self.kv = kv
        self.info = info
        # NOTE: offload keys are the prefix hashes, which exist only with prefix caching; without
        # it the offload tier (and swap preemption) is off, and that is said, never silent.
        self.offload = offload if config.enable_prefix_caching else None
        if offload is not None and self.offload is None:
            log.warning("prefix caching is off, so the offload-store is not used: no offload reloads, "
                        "and preemption_mode=%s falls back to recompute", config.preemption_mode)
        self.hash_seed = hash_seed
        self.block_size = info.block_size
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # in the order they were (re)admitted
        self.requests: dict[str, Request] = {}
        self._pending_frees: list[str] = []  # finished/preempted, not yet freed in the manager
        # Released before their latest allocation ran: the manager must unregister its blocks.
        self._pending_rollbacks: list[str] = []
        self._runner_forget: list[str] = []  # finished/preempted, not yet forgotten by the runner
        self._seq = 0
        self._step_id = 0
        self.last_kv_stats: KVCacheStats | None = None
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue management
    def add(self, request: Request) -> None:
        """Queues a validated request (its id must be unique among live requests)."""
        if request.request_id in self.requests:
            raise InvalidArgument(f"request_id {request.request_id!r} is already in use")
        request.seq = self._seq
        self._seq += 1
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: str = "",
               rollback: bool = False) -> bool:
        """Ends a request (abort, stop string, deadline); its blocks are freed at the next step.

        ``rollback``: its latest allocation may not have run (a failed step), so the blocks that
        allocation registered must be unregistered rather than kept as cache.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._retire(req, reason, stop_reason, rollback)
        return True

    def _retire(self, req: Request, reason: FinishReason, stop_reason: str = "", rollback: bool = False) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        if req.num_tokens_sent_to_kvm:
            (self._pending_rollbacks if rollback else self._pending_frees).append(req.request_id)
        if req.known_to_runner:
            self._runner_forget.append(req.request_id)

    def requeue_all(self) -> int:
        """Sends every live request back to waiting, to be recomputed from its tokens.

        For a re-bind (docs/reliability.md): the kv-cache-manager or the model-runner lost (or
        never had) the state of these requests, so no block table, pending free or runner-side
        request survives; greedy output is unchanged, exactly as after a recompute preemption.

        Returns:
            How many requests were running.
        """
        running, self.running = self.running, []
        for req in self.requests.values():
            req.known_to_runner = False
            req.num_computed_tokens = 0
            req.num_tokens_sent_to_kvm = 0
            req.block_ids = []
            req.block_hashes = []  # the seed or block size may have changed with the runner
            req.num_cached_tokens = -1  # a hit counted against the old binding is not one
        for req in running:
            req.status = RequestStatus.WAITING
            req.num_preemptions += 1
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
        self._pending_frees.clear()
        self._pending_rollbacks.clear()
        self._runner_forget.clear()
        return len(running)

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (including flushing frees)."""
        return bool(self.waiting or self.running)

    def take_pending_frees(self) -> tuple[list[str], list[str]]:
        """Frees and rollbacks not yet sent (for an idle engine to flush outside a step)."""
        frees, self._pending_frees = self._pending_frees, []
        rollbacks, self._pending_rollbacks = self._pending_rollbacks, []
        return frees, rollbacks

    # ----------------------------------------------------------------- planning
    def _block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally: each block is hashed once.

        The one computation of a request's hashes: the kv-cache-manager's prefix map and the
        offload-store's keys both take these.
        """
        return req.block_hashes[: self._extend_hashes(req)]

    def _extend_hashes(self, req: Request) -> int:
        """Hashes the full blocks not hashed yet; returns how many full blocks the request has."""
        n_full = req.num_tokens // self.block_size
        if len(req.block_hashes) < n_full:
            start = len(req.block_hashes)
            req.block_hashes.extend(hash_blocks(
                self.hash_seed, req.all_token_ids(), self.block_size, req.spec.cache_salt,
                start_block=start, parent=req.block_hashes[-1] if start else None,
            ))
        return n_full

    def _allocation(self, req: Request, num_new: int, is_new: bool, external: int = 0) -> AllocationSpec:
        """What the kv-cache-manager gets: the tokens and full-block hashes it does not know yet.

        Every allocation sends the hashes of every full block of the tokens known so far, so the
        manager holds ``num_tokens_sent_to_kvm // block_size`` of them and the rest follow here.
        """
        start = 0 if is_new else req.num_tokens_sent_to_kvm
        n_full = self._extend_hashes(req)
        return AllocationSpec(
            request_id=req.request_id,
            new_token_ids=tuple(req.token_ids_from(start)),
            num_new_tokens=num_new,
            is_new=is_new,
            use_prefix_cache=self.config.enable_prefix_caching,
            is_resumed=is_new and req.num_preemptions > 0,
            num_external_blocks=external,
            block_hashes=tuple(req.block_hashes[start // self.block_size : n_full]),
        )

    def schedule(self) -> ScheduledStep | None:
        """Plans one step and allocates its slots; None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        running_plan: list[tuple[Request, int]] = []
        for req in self.running:
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            running_plan.append((req, num_new))
            budget -= num_new
        new_plan: list[tuple[Request, int]] = []
        seats = self.config.max_num_seqs - len(self.running)
        for req in self.waiting:
            if budget <= 0 or seats <= 0:
                break
            num_new = min(req.num_tokens, budget)
            new_plan.append((req, num_new))
            budget -= num_new
            seats -= 1
        if not running_plan and not new_plan:
            return None

        allocations = [self._allocation(r, n, False) for r, n in running_plan]
        externals = [0] * len(new_plan)
        if self.offload is not None and new_plan:
            # One offload-store call for every new request of the step.
            externals = self.offload.lookup([self._block_hashes(r) for r, _ in new_plan])
        allocations += [self._allocation(r, n, True, ext) for (r, n), ext in zip(new_plan, externals, strict=True)]
        result = self._kv_step(allocations)
        num_running = len(running_plan)
        run_results = list(result.results[:num_running])
        new_results = list(result.results[num_running:])

        admitted: list[tuple[Request, AllocationResult]] = []
        refused_new = False
        for (req, _), res in zip(new_plan, new_results, strict=True):
            if res.status is AllocationStatus.OK and not refused_new:
                admitted.append((req, res))
            else:
                # NOTE: first-come-first-served: once one waiting request does not fit, later ones
                # that did fit are released too, so a large request is not starved by small ones.
                refused_new = True
                if res.status is AllocationStatus.OK:
                    self._pending_rollbacks.append(req.request_id)
        preempted: list[str] = []
        scheduled: list[tuple[Request, AllocationResult]] = []
        granted = {req.request_id for (req, _), res in zip(running_plan, run_results, strict=True)
                   if res.status is AllocationStatus.OK}
        for (req, num_new), res in zip(running_plan, run_results, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older request
            if res.status is AllocationStatus.OK:
                scheduled.append((req, res))
                continue
            ok = self._preempt_until_fits(req, num_new, scheduled, admitted, preempted, granted)
            if ok is not None:
                scheduled.append((req, ok))
        admitted = [(req, self._load_external(req, res)) for req, res in admitted]
        for req, res in admitted:
            self._admit(req, res)
        if refused_new and self._pending_rollbacks:
            # Release over-admitted requests now so their blocks are not held a whole step.
            self.last_kv_stats = self.kv.free(*self.take_pending_frees())
        return self._build_step(scheduled, admitted, preempted)

    def _kv_step(self, allocations: list[AllocationSpec]) -> StepResult:
        """One kv-cache-manager call (pending frees first); evicted cached blocks are saved
        before anything overwrites them."""
        frees, rollbacks = self.take_pending_frees()
        try:
            result = self.kv.step(frees, allocations, rollbacks)
        except Exception:
            self._pending_frees[:0] = frees  # not applied: send them again next time
            self._pending_rollbacks[:0] = rollbacks
            raise
        self.last_kv_stats = result.stats
        if self.offload is not None and result.evicted:
            self.offload.save([(e.block_hash, e.block_id) for e in result.evicted])
        return result

    def _load_external(self, req: Request, res: AllocationResult) -> AllocationResult:
        """Fills the blocks the store holds; a failed tail is recomputed in this same step."""
        if self.offload is None or not res.external_block_ids:
            return res
        first = res.num_cached_tokens // self.block_size
        ext = list(res.external_block_ids)
        hashes = self._block_hashes(req)[first : first + len(ext)]
        loaded = self.offload.load(list(zip(hashes, ext, strict=True)))
        missing = (len(ext) - loaded) * self.block_size
        if missing == 0:
            return res
        # NOTE: those blocks stay allocated; the runner recomputes their tokens into them, so the
        # hashes the kv-cache-manager registered for them hold the right bytes by the step's end.
        return dataclasses.replace(res, num_computed_tokens=res.num_computed_tokens - missing,
                                   num_new_tokens=res.num_new_tokens + missing)

    def _preempt_until_fits(
        self,
        req: Request,
        num_new: int,
        scheduled: list[tuple[Request, AllocationResult]],
        admitted: list[tuple[Request, AllocationResult]],
        preempted: list[str],
        granted: set[str],
    ) -> AllocationResult | None:
        """Preempts the newest requests until ``req`` gets its slots, or preempts ``req`` itself.

        ``granted``: running requests whose allocation in this step's call succeeded; one of them
        preempted now is rolled back, since the slots it was granted will never be computed.
        """
        while True:
            if admitted:
                victim, _ = admitted.pop()  # admitted this step: newest of all, nothing computed yet
                self._preempt(victim, was_admitting=True)
            else:
                victim = self.running[-1]
                self._preempt(victim, rollback=victim.request_id in granted)
                scheduled[:] = [(r, a) for r, a in scheduled if r is not victim]
                if victim is req:
                    preempted.append(req.request_id)
                    return None
            preempted.append(victim.request_id)
            result = self._kv_step([self._allocation(req, num_new, False)])
            if result.results[0].status is AllocationStatus.OK:
                return result.results[0]

    def _preempt(self, req: Request, was_admitting: bool = False, rollback: bool = False) -> None:
        """Frees everything and requeues the request at the front of its priority.

        With ``preemption_mode=swap`` its computed full blocks are saved to the offload-store
        first, so resuming loads them instead of recomputing. A request admitted this step
        (``was_admitting``) or granted this step's slots (``rollback``) is freed with a rollback:
        blocks registered for tokens that will not be computed must not stay in the prefix cache.
        """
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if self.config.preemption_mode == "swap" and self.offload is not None:
                n_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
                hashes = self._block_hashes(req)[:n_full]
                self.offload.save(list(zip(hashes, req.block_ids[: len(hashes)], strict=True)))
        rollback = rollback or was_admitting
        (self._pending_rollbacks if rollback else self._pending_frees).append(req.request_id)
        if req.known_to_runner:
            self._runner_forget.append(req.request_id)
        req.known_to_runner = False
        req.num_computed_tokens = 0
        req.num_tokens_sent_to_kvm = 0
        req.block_ids = []
        req.status = RequestStatus.WAITING
        if not was_admitting:
            req.num_preemptions += 1
            self.num_preemptions += 1
        if req not in self.waiting:
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _admit(self, req: Request, res: AllocationResult) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.times.first_scheduled is None:
            req.times.first_scheduled = time.monotonic()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = res.num_computed_tokens

    def _build_step(
        self,
        scheduled: list[tuple[Request, AllocationResult]],
        admitted: list[tuple[Request, AllocationResult]],
        preempted: list[str],
    ) -> ScheduledStep:
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        for req, res in scheduled:
            cached.append(CachedRequestData(
                request_id=req.request_id, new_block_ids=tuple(res.new_block_ids),
                num_computed_tokens=req.num_computed_tokens, num_new_tokens=res.num_new_tokens,
            ))
            req.block_ids.extend(res.new_block_ids)
            req.num_tokens_sent_to_kvm = req.num_tokens
            num_scheduled[req.request_id] = res.num_new_tokens
        for req, res in admitted:
            if req.is_finished or req.status is not RequestStatus.RUNNING:
                continue
            req.block_ids = list(res.new_block_ids)
            req.num_computed_tokens = res.num_computed_tokens
            req.num_tokens_sent_to_kvm = req.num_tokens
            req.known_to_runner = True
            new_reqs.append(NewRequestData(
                request_id=req.request_id, token_ids=tuple(req.all_token_ids()),
                num_prompt_tokens=req.num_prompt_tokens, block_ids=tuple(req.block_ids),
                num_computed_tokens=req.num_computed_tokens, num_new_tokens=res.num_new_tokens,
                sampling=req.spec.sampling,
            ))
            num_scheduled[req.request_id] = res.num_new_tokens
        forget, self._runner_forget = self._runner_forget, []
        self._step_id += 1
        step_input = StepInput(
            step_id=self._step_id, new_requests=tuple(new_reqs), cached_requests=tuple(cached),
            finished_request_ids=tuple(forget),
        )
        return ScheduledStep(step_input, num_scheduled, preempted, self.last_kv_stats)

    # ----------------------------------------------------------------- results
    def update(self, step: ScheduledStep, output: StepOutput) -> list[TokenEvent]:
        """Advances computed counts, appends sampled tokens, retires finished requests."""
        now = time.monotonic()
        sampled = {s.request_id: s for s in output.sampled}
        events: list[TokenEvent] = []
        for request_id, num_new in step.num_scheduled.items():
            req = self.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran; its token is dropped
            req.num_computed_tokens += num_new
            s = sampled.get(request_id)
            if s is None:
                continue
            req.output_token_ids.append(s.token_id)
            req.times.on_token(now)
            reason, stop_reason = self._check_stop(req, s.token_id)
            if reason is not None:
                self.running.remove(req)
                self._retire(req, reason, stop_reason)
            events.append(TokenEvent(req, s.token_id, reason is not None, s.logprobs))
        return events

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason | None, str]:
        params = req.spec.sampling
        if not params.ignore_eos and token in self.info.eos_token_ids:
            return FinishReason.STOP, ""
        if token in params.stop_token_ids:
            return FinishReason.STOP, str(token)
        if len(req.output_token_ids) >= req.spec.max_tokens or req.num_tokens >= self.info.max_model_len:
            return FinishReason.LENGTH, ""
        return None, ""

    def expire(self, now: float, ids: Sequence[str] | None = None) -> list[Request]:
        """Aborts requests past their deadline; returns them."""
        expired = [r for r in list(self.requests.values())
                   if r.spec.deadline is not None and now > r.spec.deadline]
        for r in expired:
            self.finish(r.request_id, FinishReason.ABORT, "deadline exceeded")
        return expired
