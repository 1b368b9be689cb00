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

The result is a :class:`ScheduledStep` (step.py); :meth:`Scheduler.update` applies the sampled
tokens and retires requests. :meth:`Scheduler.plan_ahead` plans the step after one in flight,
without the kv-cache-manager (async scheduling, lookahead.py). Queues: queues.py; hashes:
block_hashes.py; victims: preemption.py.
"""

from __future__ import annotations

import functools
import logging
import time

from services.kv_cache_manager.client import KVCacheBackend
from services.kv_cache_manager.types import (
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    KVCacheStats,
    StepResult,
)
from services.model_runner.client import RunnerInfo
from services.model_runner.types import StepOutput
from services.scheduler.block_hashes import extend_hashes, full_block_hashes, load_external
from services.scheduler.config import SchedulerConfig
from services.scheduler.lookahead import plan_ahead
from services.scheduler.offload import OffloadConnector
from services.scheduler.preemption import preempt_until_fits
from services.scheduler.queues import RequestQueues
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.step import ScheduledStep, TokenEvent, build_step
from shared.hashing import BlockHash

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting and running queues and the per-request state; decides each step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheBackend, info: RunnerInfo,
                 offload: OffloadConnector | None = None, hash_seed: bytes = b"") -> None:
        """Args:
            offload: the offload-store connector, or None to run without the offload tier.
            hash_seed: the prefix-hash chain root; the scheduler is its one owner (block_hashes.py).
        """
        self.config = config
        self.kv = kv
        self._connector = offload
        self.offload: OffloadConnector | None = None
        self._offload_off = ""  # why the connector is not used ("" when it is, or there is none)
        self.info = info
        self.num_groups = 1
        self.bind_runner(info)
        self.hash_seed = hash_seed
        self.queues = RequestQueues()
        self._step_id = 0
        self.last_kv_stats: KVCacheStats | None = None
        self.num_preemptions = 0

    def bind_runner(self, info: RunnerInfo) -> None:
        """Takes the runner's geometry: block size, KV cache groups, and whether offload can serve it.

        NOTE: offload keys are the prefix hashes, which exist only with prefix caching; without it
        the offload tier (and swap preemption) is off. It is off too for a model with a sliding-window
        KV cache group: the store moves one block per hash by leading-prefix semantics, while such a
        model holds one block per hash *per group* and a window group's blocks are neither leading
        nor kept (docs/design.md, "Block tables per group"). With the tier off, P/D publishing (a
        prefill replica's) is off as well; a decode replica then recomputes the prompt, with the
        same answer. Both are said, never silent.
        """
        self.info = info
        self.block_size = info.block_size
        self.num_groups = len(info.kv_group_windows)
        offload = self._connector
        windows = sorted({w for w in info.kv_group_windows if w is not None})
        self.offload = offload if self.config.enable_prefix_caching and not windows else None
        why = "" if offload is None or self.offload is not None else (
            "prefix caching is off, so the offload-store is not used: no offload reloads, and "
            f"preemption_mode={self.config.preemption_mode} falls back to recompute" if not windows else
            f"the model has sliding-window KV cache groups (windows {windows}), so the offload-store is not "
            "used: no offload reloads, no prefill publishing (P/D), and preemption_mode="
            f"{self.config.preemption_mode} falls back to recompute")
        if why and why != self._offload_off:  # said once per decision, not at every re-bind
            log.warning("%s", why)
        self._offload_off = why

    # ----------------------------------------------------------------- queues (queues.py)
    @property
    def waiting(self) -> list[Request]:
        """Waiting requests in (priority, arrival) order."""
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        """Running requests in admission order (the newest is preempted first)."""
        return self.queues.running

    @property
    def requests(self) -> dict[str, Request]:
        """Every live request by id."""
        return self.queues.requests

    def add(self, request: Request) -> None:
        """Queues a validated request (its id must be unique among live requests)."""
        self.queues.add(request)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: str = "",
               rollback: bool = False) -> bool:
        """Ends a request (abort, stop string, deadline); its blocks are freed at the next step.

        ``rollback``: its latest allocation may not have run (a failed step), so the blocks that
        allocation registered must be unregistered rather than kept as cache.
        """
        return self.queues.finish(request_id, reason, stop_reason, rollback)

    def requeue_all(self) -> int:
        """Sends every live request back to waiting, to be recomputed from its tokens.

        For a re-bind (docs/reliability.md): the kv-cache-manager or the model-runner lost (or
        never had) the state of these requests, so no block table, pending free or runner-side
        request survives; greedy output is unchanged, exactly as after a recompute preemption.

        Returns:
            How many requests were running.
        """
        return self.queues.requeue_all()

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (including flushing frees)."""
        return bool(self.waiting or self.running)

    def take_pending_frees(self) -> tuple[list[str], list[str]]:
        """Frees and rollbacks not yet sent (for an idle engine to flush outside a step)."""
        return self.queues.take_pending_frees()

    # ----------------------------------------------------------------- planning
    def _block_hashes(self, req: Request) -> list[BlockHash]:
        """The request's full-block hashes (block_hashes.py: the one computation, once per block)."""
        return full_block_hashes(req, self.hash_seed, self.block_size)

    def _allocation(self, req: Request, num_new: int, is_new: bool, external: int = 0) -> AllocationSpec:
        """What the kv-cache-manager gets: the tokens and full-block hashes it does not know yet.

        Every allocation sends the hashes of every full block of the tokens known so far, so the
        manager holds ``num_tokens_sent_to_kvm // block_size`` of them and the rest follow here;
        a running request's count includes the tokens steps sent ahead computed unasked
        (``num_unreported_tokens``), so the manager's computed count catches up.
        """
        start = 0 if is_new else req.num_tokens_sent_to_kvm
        n_full = extend_hashes(req, self.hash_seed, self.block_size)
        return AllocationSpec(
            request_id=req.request_id,
            new_token_ids=tuple(req.token_ids_from(start)),
            num_new_tokens=num_new if is_new else num_new + req.num_unreported_tokens,
            is_new=is_new,
            use_prefix_cache=self.config.enable_prefix_caching,
            is_resumed=is_new and req.num_preemptions > 0,
            num_external_blocks=external,
            block_hashes=tuple(req.block_hashes[start // self.block_size : n_full]),
            # With async scheduling a block's worth of slots is reserved ahead, when the pool has
            # them, so the steps sent ahead rarely stop at a block boundary (lookahead.py).
            num_lookahead_tokens=self.block_size if self.config.sends_ahead else 0,
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
                    self.queues.pending_rollbacks.append(req.request_id)
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
            retry = functools.partial(self._retry, req, num_new)
            ok = preempt_until_fits(req, self.running, scheduled, admitted, preempted, granted, self._preempt, retry)
            if ok is not None:
                scheduled.append((req, ok))
        if self.offload is not None:
            offload = self.offload
            admitted = [(req, load_external(offload, res, self._block_hashes(req), self.block_size))
                        for req, res in admitted]
        for req, res in admitted:
            self._admit(req, res)
        if refused_new and self.queues.pending_rollbacks:
            # Release over-admitted requests now so their blocks are not held a whole step.
            self.last_kv_stats = self.kv.free(*self.take_pending_frees())
        self._step_id += 1
        return build_step(self._step_id, scheduled, admitted, preempted, self.queues.take_runner_forget(),
                          self.last_kv_stats, self.num_groups)

    def plan_ahead(self, prev: ScheduledStep) -> ScheduledStep | None:
        """The step to send while ``prev`` runs (async scheduling, lookahead.py), or None when the
        next step must be planned synchronously, after ``prev`` returns."""
        step = plan_ahead(prev, self.queues, self._step_id + 1, self.block_size, self.info.max_model_len,
                          self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if step is not None:
            self._step_id += 1
        return step

    def _kv_step(self, allocations: list[AllocationSpec]) -> StepResult:
        """One kv-cache-manager call (pending frees first); evicted cached blocks are saved
        before anything overwrites them."""
        frees, rollbacks = self.take_pending_frees()
        try:
            result = self.kv.step(frees, allocations, rollbacks)
        except Exception:
            self.queues.pending_frees[:0] = frees  # not applied: send them again next time
            self.queues.pending_rollbacks[:0] = rollbacks
            raise
        self.last_kv_stats = result.stats
        if self.offload is not None and result.evicted:
            self.offload.save([(e.block_hash, e.block_id) for e in result.evicted])
        return result

    def _retry(self, req: Request, num_new: int) -> AllocationResult:
        """A running request's allocation sent again, alone, after a preemption made room."""
        return self._kv_step([self._allocation(req, num_new, False)]).results[0]

    def _preempt(self, req: Request, was_admitting: bool = False, rollback: bool = False) -> None:
        """Frees everything and requeues the request at the front of its priority.

        With ``preemption_mode=swap`` its computed full blocks are saved to the offload-store
        first, so resuming loads them instead of recomputing. A request admitted this step
        (``was_admitting``) or granted this step's slots (``rollback``) is freed with a rollback:
        blocks registered for tokens that will not be computed must not stay in the prefix cache.
        """
        if req.status is RequestStatus.RUNNING and self.config.preemption_mode == "swap" and self.offload is not None:
            table = req.block_tables[0]  # the only one: the offload tier is off for several groups
            n_full = min(req.num_computed_tokens // self.block_size, len(table))
            hashes = self._block_hashes(req)[:n_full]
            self.offload.save(list(zip(hashes, table[: len(hashes)], strict=True)))
        self.queues.release(req, rollback=rollback or was_admitting)
        if not was_admitting:  # a request admitted this step was never running: not a preemption
            req.num_preemptions += 1
            self.num_preemptions += 1

    def _admit(self, req: Request, res: AllocationResult) -> None:
        self.queues.admit(req)
        if req.times.first_scheduled is None:
            req.times.first_scheduled = time.monotonic()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = res.num_computed_tokens

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
                self.queues.finish(request_id, reason, stop_reason)
            events.append(TokenEvent(req, s.token_id, reason is not None, s.logprobs))
        return events

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason | None, str]:
        params = req.spec.sampling
        if not params.ignore_eos and token in self.info.eos_token_ids:
            return FinishReason.STOP, ""
        if token in params.stop_token_ids:
            return FinishReason.STOP, str(token)
        if req.at_length(self.info.max_model_len):
            return FinishReason.LENGTH, ""
        return None, ""

    def expire(self, now: float) -> list[Request]:
        """Aborts requests past their deadline; returns them."""
        expired = [r for r in list(self.requests.values())
                   if r.spec.deadline is not None and now > r.spec.deadline]
        for r in expired:
            self.finish(r.request_id, FinishReason.ABORT, "deadline exceeded")
        return expired
